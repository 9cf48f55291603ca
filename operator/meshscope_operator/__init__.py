"""The meshscope Kubernetes operator (kopf): admission, reconcile, and the cost table in a TrainingJob's status.

Admission:

- :mod:`~meshscope_operator.reviews`: pure: the TrainingJob webhook's verdict (denial with the numbers, or the
  planner's findings as warnings);
- :mod:`~meshscope_operator.injection`: pure: the pod webhook's JSON patch (the native sidecar, its volumes and
  environment);
- :mod:`~meshscope_operator.admission`: the two webhooks as kopf handlers, thin.

Reconcile:

- :mod:`~meshscope_operator.children`, :mod:`~meshscope_operator.placements`, :mod:`~meshscope_operator.runs`,
  :mod:`~meshscope_operator.statuses`: pure: the owned objects, where the pods landed, the run's phase, what status
  says;
- :mod:`~meshscope_operator.reconciling`, :mod:`~meshscope_operator.following`: the handlers' work, through
  :mod:`~meshscope_operator.kubeapi` (the few API calls, one aiohttp session).

The cost table (docs/operator.md, "The cost table: two tiers"):

- :mod:`~meshscope_operator.promql`: the continuous tier's bounded store queries;
- :mod:`~meshscope_operator.deep`: the deep tier: one window of records from every sidecar, analysed by the core;
- :mod:`~meshscope_operator.costs`: the status summary and ConfigMap from either;
- :mod:`~meshscope_operator.tiers`: both tiers as kopf timers and an annotation handler;
- :mod:`~meshscope_operator.bodies`: HTTP answers read whole to a byte cap.

Around them: :mod:`~meshscope_operator.settings` (``MESHSCOPE_OPERATOR_*`` variables), :mod:`~meshscope_operator.spec`
(TrainingJob objects -> the core's ``JobSpec``, in one place), :mod:`~meshscope_operator.handlers` (every handler on
an explicit registry), :mod:`~meshscope_operator.__main__` (the ``meshscope-operator`` entry point) and
:mod:`~meshscope_operator.kubectl_plugin` (``kubectl meshscope cost|plan``, which needs only the core and kubectl, not
kopf). The operator imports the core only through its package faces and never the sidecar.
"""
