"""The meshscope sidecar: collects training-loop events, DCGM/NVML, NCCL and InfiniBand readings next to each pod.

Built in a later issue; the package exists now so that the distribution, the import contracts and the layout of the
repository have their final shape.
"""
