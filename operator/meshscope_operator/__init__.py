"""The meshscope Kubernetes operator (kopf): admission webhooks for TrainingJobs and training pods.

- :mod:`~meshscope_operator.settings`: :class:`OperatorSettings`, from ``MESHSCOPE_OPERATOR_*`` variables;
- :mod:`~meshscope_operator.spec`: TrainingJob objects (typed JSON) -> the core's ``JobSpec``, in one place;
- :mod:`~meshscope_operator.reviews`: pure: the TrainingJob webhook's verdict (denial with the numbers, or the
  planner's findings as warnings);
- :mod:`~meshscope_operator.injection`: pure: the pod webhook's JSON patch (the native sidecar, its volumes and
  environment);
- :mod:`~meshscope_operator.admission`: the two webhooks as kopf handlers, thin;
- :mod:`~meshscope_operator.handlers`: :func:`register`, every handler on an explicit registry;
- :mod:`~meshscope_operator.__main__`: the ``meshscope-operator`` entry point;
- :mod:`~meshscope_operator.kubectl_plugin`: ``kubectl-meshscope`` (``kubectl meshscope cost|plan``), which needs
  only the core and kubectl, not kopf.

Reconcile (the Indexed Job, status, the cost table) comes in later slices of issue 11 (docs/operator.md). It
imports the core only through its package faces and never the sidecar.
"""
