"""Cross-field rules of a TrainingJob: the arithmetic a schema cannot express.

Degrees against heads, FFN width, sequence length, experts and layers; batch against micro-batches and the pipeline
schedule. The loader runs them on every manifest (:mod:`meshscope.jobs.loading`) and the layout search runs them on
every candidate it builds (:mod:`meshscope.plan.search`), so both accept exactly the same jobs. Every rule raises
:class:`~meshscope.errors.SpecError` naming the field, the numbers and what would fit; nothing here reads YAML.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshscope.errors import SpecError
from meshscope.jobs.spec import CpCommType, PipelineSchedule

if TYPE_CHECKING:
    from meshscope.jobs.models import ModelConfig
    from meshscope.jobs.spec import JobSpec, ParallelismConfig
    from meshscope.topology import ParallelLayout


def check_job(spec: JobSpec) -> None:
    """The cross-field checks of a typed spec: heads, FFN, context and expert parallelism, layer split, batch.

    The loader runs them on every manifest; the layout search runs them on every candidate it builds, so both
    accept exactly the same jobs.

    Raises:
        SpecError: naming the field, the numbers and what would fit.
    """
    layout = spec.layout
    check_heads(spec.model, layout)
    check_ffn(spec.model, layout)
    check_context_parallel(spec.model, layout)
    check_cp_comm_type(spec.model, spec.parallelism)
    check_experts(spec.model, layout)
    check_pipeline_split(spec.model, spec.parallelism)
    training = spec.training
    check_batch(training.global_batch_size, training.micro_batch_size, layout, training.pipeline_schedule)


def check_heads(model: ModelConfig, layout: ParallelLayout) -> None:
    """Heads divisible by tp; tp and KV heads divide one another (Megatron replicates KV heads when tp > kvHeads)."""
    tp, heads, kv_heads = layout.tp, model.attention_heads, model.groups
    if heads % tp:
        raise SpecError(
            "spec.model.attentionHeads",
            f"model.heads ({heads}) is not divisible by tp ({tp}); use tp among {divisors_text(heads)}",
        )
    if model.mla is None and tp % kv_heads and kv_heads % tp:
        raise SpecError(
            "spec.model.kvHeads",
            f"model.kvHeads ({kv_heads}) and tp ({tp}): one must divide the other (each TP rank holds kvHeads/tp "
            f"key/value heads, or Megatron replicates them when tp > kvHeads); use tp among "
            f"{divisors_text(kv_heads)} or a multiple of {kv_heads}",
        )


def check_ffn(model: ModelConfig, layout: ParallelLayout) -> None:
    """Dense FFN divisible by tp, expert FFN by etp, shared experts' FFN by tp."""
    tp, etp = layout.tp, layout.expert_tp
    moe = model.moe
    if (moe is None or moe.dense_layers > 0) and model.ffn_hidden_size % tp:
        raise SpecError(
            "spec.model.ffnHiddenSize",
            f"model.ffnHiddenSize ({model.ffn_hidden_size}) is not divisible by tp ({tp}); use tp among "
            f"{divisors_text(model.ffn_hidden_size)}",
        )
    if moe is None:
        return
    if moe.expert_ffn_hidden_size % etp:
        raise SpecError(
            "spec.model.moe.expertFfnHiddenSize",
            f"model.moe.expertFfnHiddenSize ({moe.expert_ffn_hidden_size}) is not divisible by etp ({etp}); use "
            f"etp among {divisors_text(moe.expert_ffn_hidden_size)}",
        )
    shared = moe.shared_experts * moe.expert_ffn_hidden_size
    if shared % tp:
        raise SpecError(
            "spec.model.moe.sharedExperts",
            f"the shared experts' FFN size sharedExperts*expertFfnHiddenSize = {moe.shared_experts}*"
            f"{moe.expert_ffn_hidden_size} = {shared} is not divisible by tp ({tp}); use tp among "
            f"{divisors_text(shared)}",
        )


def check_context_parallel(model: ModelConfig, layout: ParallelLayout) -> None:
    """Sequence length divisible by 2*cp (context parallelism load-balances 2*cp chunks)."""
    cp, seq = layout.cp, model.seq_length
    if cp > 1 and seq % (2 * cp):
        raise SpecError(
            "spec.parallelism.cp",
            f"model.seqLength ({seq}) is not divisible by 2*cp (2*{cp} = {2 * cp}): context parallelism splits "
            f"each sequence into 2*cp chunks for load balance; use cp among "
            f"{divisors_text(seq // 2) if seq % 2 == 0 else '1'}",
        )


def check_cp_comm_type(model: ModelConfig, parallelism: ParallelismConfig) -> None:
    """``a2a`` (Ulysses) context parallelism splits the heads of every tensor-parallel rank over cp.

    Transformer Engine's ``AttnFuncWithCPAndQKVOA2A`` asserts ``num_heads % cp_size == 0`` for Q, K and V: the query
    heads ``a/tp`` and the key/value heads ``max(g/tp, 1)`` of one tensor-parallel rank (Megatron replicates KV heads
    when tp > kvHeads) must both divide by cp. MLA has as many key/value heads as query heads.
    """
    cp = parallelism.layout.cp
    if cp == 1 or parallelism.cp_comm_type is not CpCommType.A2A:
        return
    tp = parallelism.layout.tp
    heads = model.attention_heads // tp
    kv_heads = heads if model.mla is not None else max(model.groups // tp, 1)
    if heads % cp == 0 and kv_heads % cp == 0:
        return
    raise SpecError(
        "spec.parallelism.cpCommType",
        f"cpCommType a2a (Ulysses) scatters each tensor-parallel rank's heads over cp, but with tp={tp} a rank "
        f"holds {heads} query and {kv_heads} key/value heads (attentionHeads {model.attention_heads}, kvHeads "
        f"{model.groups}), not both divisible by cp ({cp}); use cp among {divisors_text(math.gcd(heads, kv_heads))}, "
        f"or cpCommType p2p or all_gather",
    )


def check_experts(model: ModelConfig, layout: ParallelLayout) -> None:
    """Expert parallelism only for MoE models, with ep dividing the number of experts."""
    ep, moe = layout.ep, model.moe
    if moe is None:
        if ep > 1:
            raise SpecError(
                "spec.parallelism.ep",
                f"ep ({ep}) > 1 needs a mixture-of-experts model, but model {model.name!r} has no experts; "
                f"set ep to 1 or add spec.model.moe",
            )
        return
    if ep > moe.experts:
        raise SpecError(
            "spec.parallelism.ep",
            f"ep ({ep}) exceeds model.moe.experts ({moe.experts}); use ep among {divisors_text(moe.experts)}",
        )
    if moe.experts % ep:
        raise SpecError(
            "spec.parallelism.ep",
            f"model.moe.experts ({moe.experts}) is not divisible by ep ({ep}); use ep among "
            f"{divisors_text(moe.experts)}",
        )


def check_pipeline_split(model: ModelConfig, parallelism: ParallelismConfig) -> None:
    """Layers (plus the embedding and loss, where counted) divisible by pp*vpp."""
    pp, vpp = parallelism.layout.pp, parallelism.layout.vpp
    chunks = pp * vpp
    extras = [
        label
        for label, on in (
            ("embedding (1)", parallelism.account_for_embedding_in_pipeline_split),
            ("loss (1)", parallelism.account_for_loss_in_pipeline_split),
        )
        if on
    ]
    total = model.layers + len(extras)
    if total % chunks == 0:
        return
    counted = f"model.layers ({model.layers})" + "".join(f" + {e}" for e in extras)
    if extras:
        counted += f" = {total}"
    hint = f"pp*vpp must divide {total}: use one of {divisors_text(total)}"
    if not extras and pp > 1 and (model.layers + 2) % chunks == 0:
        hint += (
            f"; or set parallelism.accountForEmbeddingInPipelineSplit and accountForLossInPipelineSplit, which split "
            f"{model.layers} + 2 = {model.layers + 2} (as Megatron does for Llama 3 405B)"
        )
    raise SpecError("spec.model.layers", f"{counted} is not divisible by pp*vpp ({pp}*{vpp}); {hint}")


def check_batch(global_batch: int, micro_batch: int, layout: ParallelLayout, schedule: PipelineSchedule) -> None:
    """Global batch divisible by micro-batch*dp; m >= pp for 1F1B and a multiple of pp for interleaved."""
    dp, pp = layout.dp, layout.pp
    unit = micro_batch * dp
    field = "spec.training.globalBatchSize"
    if global_batch % unit:
        raise SpecError(
            field,
            f"training.globalBatchSize ({global_batch}) is not divisible by microBatchSize*dp ({micro_batch}*{dp} "
            f"= {unit}); use a multiple of {unit}, e.g. {nearest_multiples(global_batch, unit)}",
        )
    m = global_batch // unit
    m_text = (
        f"micro-batches per step m = globalBatchSize/(microBatchSize*dp) = {global_batch}/({micro_batch}*{dp}) = {m}"
    )
    if pp > 1 and schedule is PipelineSchedule.ONE_F_ONE_B and m < pp:
        raise SpecError(
            field,
            f"{m_text} < pp ({pp}): the 1F1B schedule needs m >= pp; use globalBatchSize >= {pp * unit}, a smaller "
            f"microBatchSize, or fewer pipeline stages",
        )
    if schedule is PipelineSchedule.INTERLEAVED and m % pp:
        raise SpecError(
            field,
            f"{m_text} is not a multiple of pp ({pp}), which the interleaved schedule needs (Megatron-core); use "
            f"globalBatchSize {nearest_multiples(global_batch, pp * unit)}",
        )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def divisors_text(n: int, limit: int = 12) -> str:
    """``1, 2, 4, 8`` (the first ``limit`` divisors of ``n``, then ``..., n``)."""
    divisors = _divisors(max(n, 1))
    if len(divisors) > limit:
        return ", ".join(str(d) for d in divisors[: limit - 1]) + f", ..., {divisors[-1]}"
    return ", ".join(str(d) for d in divisors)


def nearest_multiples(value: int, unit: int) -> str:
    """The multiples of ``unit`` nearest ``value``, for hints: ``"96 or 128"``."""
    return " or ".join(str(v) for v in _nearest(value, unit))


def _nearest(value: int, unit: int) -> list[int]:
    below = value // unit * unit
    return [v for v in (below, below + unit) if v > 0]
