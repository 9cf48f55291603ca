"""The meshscope Kubernetes operator (kopf): plans TrainingJobs on admission and writes the cost table to status.

Built in a later issue; the package exists now so that the distribution, the import contracts and the layout of the
repository have their final shape.
"""
