"""Following a TrainingJob's children: the Job's run into status, and children that go away made again.

Exists because reconcile runs on spec changes and operator starts only, while a TrainingJob's Job changes on its
own (pods start, become ready, finish, fail) and its children can be deleted under it. Three kopf event handlers
on objects labelled ``meshscope.io/trainingjob`` (no finalizer is put on any of them):

- **a Job's event** (added, modified): its status mapped to the TrainingJob's ``phase`` and ``Running`` condition
  (:func:`~meshscope_operator.runs.job_progress`), merge-patched into the TrainingJob's status only when they
  change; the patch names the TrainingJob's ``resourceVersion`` (the API server refuses it with 409 if the object
  changed since it was read: no other writer's conditions are lost), and holds only ``phase`` and ``conditions``
  (every other field, the cost table's included, is left as it is);
- **a Job or Service deleted**: the TrainingJob is read and reconciled again (the same code as on a spec change), so
  what is missing is made again, unless the TrainingJob is gone or being deleted (the garbage collector is removing
  its children), or the Job was a finished run of this spec (:func:`~meshscope_operator.runs.finished_run`);
- **the placement ConfigMap deleted**: published again from the pod index.

A restore or a status write that fails is not retried by kopf (event handlers are not); it is kept pending here and
tried again by one task of the operator's with a delay doubling from 5 s to 300 s per TrainingJob, the failure
written into the ``Ready`` condition by reconcile. One restore at a time per TrainingJob.

It must hold no builders of its own: manifests, status and phases come from the pure modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import kopf

from meshscope_operator.children import owned_by, placement_name
from meshscope_operator.injection import LABEL
from meshscope_operator.kubeapi import ApiError, KubeApi
from meshscope_operator.reconciling import (
    PlacementPublisher,
    now_rfc3339,
    publish_logged,
    reconcile_training_job,
    retry_delay,
)
from meshscope_operator.runs import job_progress, stored_condition
from meshscope_operator.spec import GROUP, PLURAL, VERSION
from meshscope_operator.statuses import ConditionType, Phase, generation_of, merge_conditions

if TYPE_CHECKING:
    from meshscope_operator.settings import OperatorSettings

IDLE_WAIT_S = 300.0
"""Longest sleep of the keeper's retry task with nothing pending (it is woken when a restore fails)."""
STATUS_ATTEMPTS = 3
"""Status writes tried (read, then patch at that resourceVersion) before the write is left to a restore."""

_log = logging.getLogger(__name__)
Key = tuple[str, str]


def _meta(body: Mapping[str, object]) -> Mapping[str, object]:
    meta = body.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def trainingjob_key(child: Mapping[str, object]) -> Key | None:
    """``(namespace, TrainingJob name)`` of a child, from its label; ``None`` without one."""
    meta = _meta(child)
    labels = meta.get("labels")
    name = labels.get(LABEL) if isinstance(labels, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    return str(meta.get("namespace") or ""), name


def trainingjob_path(key: Key) -> str:
    """The TrainingJob's URL path."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{key[0]}/{PLURAL}/{key[1]}"


def is_going(body: Mapping[str, object] | None) -> bool:
    """Whether a TrainingJob is gone or being deleted (its children are then the garbage collector's)."""
    return body is None or bool(_meta(body).get("deletionTimestamp"))


def job_status_patch(tj: Mapping[str, object], job: Mapping[str, object], now: str) -> dict[str, object] | None:
    """The ``phase`` and ``conditions`` of ``tj`` after its Job ``job``; ``None`` when the status says that already.

    An ``Invalid`` TrainingJob keeps its phase (the spec is what is wrong; the Job runs an earlier one); only its
    ``Running`` condition follows the Job.
    """
    spec = job.get("spec")
    completions = spec.get("completions") if isinstance(spec, Mapping) else None
    nodes = completions if isinstance(completions, int) and not isinstance(completions, bool) else 0
    progress = job_progress(job, max(nodes, 1))
    raw_status = tj.get("status")
    status: Mapping[str, object] = raw_status if isinstance(raw_status, Mapping) else {}
    phase = status.get("phase")
    new_phase = phase if phase == Phase.INVALID.value else progress.phase.value
    old = stored_condition(tj, ConditionType.RUNNING)
    running = progress.running
    same = (
        old is not None
        and old.get("status") == ("True" if running.status else "False")
        and old.get("reason") == running.reason
        and old.get("message") == running.message
        and old.get("observedGeneration") == generation_of(tj)
    )
    if same and phase == new_phase:
        return None
    conditions = merge_conditions(status.get("conditions"), [running], generation=generation_of(tj), now=now)
    return {"phase": new_phase, "conditions": conditions}


class ChildKeeper:
    """Follows each TrainingJob's Job into its status, and makes missing children again, with a backoff."""

    def __init__(
        self,
        api: KubeApi,
        settings: OperatorSettings,
        publisher: PlacementPublisher,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Bind the API, the settings and the placement publisher; ``clock`` is monotonic seconds."""
        self._api = api
        self._settings = settings
        self._publisher = publisher
        self._clock = clock
        self._pending: dict[Key, tuple[int, float]] = {}
        """Per TrainingJob: failures so far, and when (clock) to try again."""
        self._locks: dict[Key, asyncio.Lock] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the retry task (the operator's startup): it restores each pending TrainingJob when its delay ends."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry_forever(), name="meshscope-keeper")

    async def stop(self) -> None:
        """Stop the retry task (the operator's cleanup)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _retry_forever(self) -> None:
        while True:
            now = self._clock()
            due = [k for k, (_, at) in self._pending.items() if at <= now]
            for key in due:
                try:
                    outcome = await self.restore(key)
                except Exception:  # noqa: BLE001 - a bug must not end the retries of every other TrainingJob
                    _log.exception("restore of TrainingJob %s/%s failed", *key)
                    self.failed(key)
                else:
                    _log.info("TrainingJob %s/%s: %s", *key, outcome)
            self._wake.clear()  # before looking: a failure counted from here on wakes the wait below
            soonest = min((at for _, at in self._pending.values()), default=self._clock() + IDLE_WAIT_S)
            wait_s = soonest - self._clock()
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)

    def pending(self, key: Key) -> tuple[int, float] | None:
        """``(failures, due time)`` of a pending restore, else ``None``."""
        return self._pending.get(key)

    def due(self, key: Key) -> bool:
        """Whether a restore of ``key`` is pending and its delay has passed."""
        entry = self._pending.get(key)
        return entry is not None and self._clock() >= entry[1]

    def failed(self, key: Key) -> float:
        """Count a failure of ``key``'s restore; the seconds until the next try (5, 10, 20, ... 300)."""
        failures = self._pending.get(key, (0, 0.0))[0]
        delay = retry_delay(failures)
        self._pending[key] = (failures + 1, self._clock() + delay)
        self._wake.set()
        return delay

    def forget(self, key: Key) -> None:
        """Drop ``key``'s pending restore (done, or nothing left to do)."""
        self._pending.pop(key, None)

    async def follow(self, job: Mapping[str, object]) -> str:
        """Write the run of Job ``job`` into its TrainingJob's status; returns what happened (for the log).

        Raises:
            ApiError: when the status could not be read or written (the caller schedules a restore).
        """
        key = trainingjob_key(job)
        if key is None:
            return "no TrainingJob label"
        for _ in range(STATUS_ATTEMPTS):
            tj = await self._api.get(trainingjob_path(key))
            if is_going(tj):
                return "TrainingJob gone or being deleted"
            assert tj is not None  # is_going
            if not owned_by(job, str(_meta(tj).get("uid"))):
                return "Job not owned by this TrainingJob"
            patch = job_status_patch(tj, job, now_rfc3339())
            if patch is None:
                return "status up to date"
            body = {"metadata": {"resourceVersion": _meta(tj).get("resourceVersion")}, "status": patch}
            try:
                await self._api.patch(f"{trainingjob_path(key)}/status", body)
            except ApiError as exc:
                if exc.status == 409:  # changed since read: read again
                    continue
                raise
            return f"phase {patch['phase']}"
        message = f"changed {STATUS_ATTEMPTS} times while written"
        raise ApiError("PATCH", f"{trainingjob_path(key)}/status", 409, message)

    async def restore(self, key: Key) -> str:
        """Reconcile TrainingJob ``key`` again (its missing children made, its status from the Job); what happened."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            return await self._restore(key)

    async def _restore(self, key: Key) -> str:
        path = trainingjob_path(key)
        failures = self._pending.get(key, (0, 0.0))[0]
        try:
            tj = await self._api.get(path)
        except ApiError:
            delay = self.failed(key)
            return f"not read; again in {delay:.0f} s"
        if is_going(tj):
            self.forget(key)
            return "TrainingJob gone or being deleted: nothing made"
        assert tj is not None  # is_going
        status: dict[str, object] = {}
        outcome = "restored"
        try:
            await reconcile_training_job(self._api, tj, status, self._settings, retry=failures)
        except kopf.TemporaryError as exc:
            delay = self.failed(key)
            outcome = f"not restored ({exc}); again in {delay:.0f} s"
        except kopf.PermanentError as exc:
            self.forget(key)  # the spec or template: nothing to retry until it changes (reconcile runs then)
            outcome = f"not restored: {exc}"
        else:
            self.forget(key)
        if status:
            body = {"metadata": {"resourceVersion": _meta(tj).get("resourceVersion")}, "status": status}
            try:
                await self._api.patch(f"{path}/status", body)
            except ApiError as exc:
                delay = self.failed(key)
                outcome += f"; status not written ({exc}); again in {delay:.0f} s"
        return outcome


def register_following(
    registry: kopf.OperatorRegistry, settings: OperatorSettings, api: KubeApi, publisher: PlacementPublisher
) -> ChildKeeper:
    """Add the handlers that follow the children to ``registry``; the keeper they share."""
    keeper = ChildKeeper(api, settings, publisher)

    @kopf.on.startup(registry=registry)
    async def start_keeper(**_: object) -> None:
        keeper.start()

    @kopf.on.cleanup(registry=registry)
    async def stop_keeper(**_: object) -> None:
        await keeper.stop()

    _register_job_and_service(registry, keeper)
    _register_placement(registry, api, publisher)
    return keeper


def _register_job_and_service(registry: kopf.OperatorRegistry, keeper: ChildKeeper) -> None:
    @kopf.on.event("batch", "v1", "jobs", id="follow-job", labels={LABEL: kopf.PRESENT}, registry=registry)
    async def follow_job(
        body: kopf.Body, event: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter[Any], **_: object
    ) -> None:
        key = trainingjob_key(body)
        if key is None:
            return
        if event.get("type") == "DELETED":
            logger.info("Job of TrainingJob %s/%s deleted: %s", *key, await keeper.restore(key))
            return
        try:
            logger.debug("TrainingJob %s/%s: %s", *key, await keeper.follow(body))
        except ApiError as exc:
            delay = keeper.failed(key)
            logger.warning("status of TrainingJob %s/%s not written: %s; again in %.0f s", *key, exc, delay)

    @kopf.on.event("v1", "services", id="keep-service", labels={LABEL: kopf.PRESENT}, registry=registry)
    async def keep_service(
        body: kopf.Body, event: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter[Any], **_: object
    ) -> None:
        key = trainingjob_key(body)
        if key is not None and event.get("type") == "DELETED":
            logger.info("Service of TrainingJob %s/%s deleted: %s", *key, await keeper.restore(key))


def _register_placement(registry: kopf.OperatorRegistry, api: KubeApi, publisher: PlacementPublisher) -> None:
    @kopf.on.event("v1", "configmaps", id="keep-placement", labels={LABEL: kopf.PRESENT}, registry=registry)
    async def keep_placement(
        body: kopf.Body,
        event: Mapping[str, Any],
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,  # noqa: ANN401 - kopf's kwargs (the indices)
    ) -> None:
        key = trainingjob_key(body)
        if key is None or event.get("type") != "DELETED" or _meta(body).get("name") != placement_name(key[1]):
            return
        try:
            going = is_going(await api.get(trainingjob_path(key)))
        except ApiError:
            going = False  # not known: the publisher's index of TrainingJobs decides
        if not going:
            await publish_logged(publisher, key, kwargs, logger, recheck=True)
