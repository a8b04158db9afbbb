"""DeepSeek-V3.2 DSA layer: MLA whose queries attend only to the tokens a lightning indexer
selects (docs/concepts.md, "DeepSeek-V3.2 DSA").

The MLA runs through the execution's attention kernel (``AbstractAttentionKernel.latent``): in
its absorbed form every head's query is mapped into the kv latent (``q_nope · W_kb_h``) so all
heads share one key ``[c_kv ; k_rope]`` and one value ``c_kv`` per token, the sparse attention
reads each query's selected latents and ``W_vb_h`` maps the result back to per-head values.
This equals expanding keys and values per head, which is what DeepSeek's inference code does in
its prefill, in bf16 torch ops: under numerics that follow it (``DeepSeekInference``) the
attention chooser runs that form (``csa_eqx._attention.expanded``).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .._attention.auto import resolved
from .._attention.base import AbstractAttentionKernel, LatentUp
from .._attention.picks import entry_reads
from .._config import V32AttentionConfig
from .._decode.cache import V32Cache, check_cache_size, empty_rows
from .._execution import Execution
from .._indexer.v32 import V32Indexer
from .._layout import Visibility
from .._loss.base import AttentionTarget
from .._numerics.base import V32_FORMATS, DeepSeekFormats
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, rms_norm, round_to, varying_like
from .._placement.heads import split_specs
from .._rope import apply_rope_interleaved, yarn_mscale, yarn_table
from .base import AbstractIndexedAttention, config_sizes
from .forward import Forward

__all__ = ["V32Attention"]


# the absorbed queries ``[B, S, heads, kv_lora + rope]`` (elements) one attention call takes;
# above ONE_CALL the call is split into parts of at most GROUP elements each, run one after the
# other, each recomputed in the backward (compiled for a v5e, V3.2 at released sizes, 128 heads
# x 576, bf16 fwd+bwd: 16k, 1.2e9, one call, 12.3 GiB of temporaries; 32k in one call 24.8 GiB,
# in 2 groups 16.4, in 4 groups 12.2; docs/memory.md, "Released sizes on one TPU v5e")
ONE_CALL = 1 << 31
GROUP = 5 << 27
# the latent outputs ``[B, S, heads, kv_lora]`` (elements) the parts keep for their backward
# (``kept_parts``), whole parts, the first ones; the others' forward is recomputed (compiled for
# a v5e, V3.2 at released sizes, bf16 fwd+bwd at 32k in 4 head groups: temporaries 11.45 GiB
# keeping none, 12.29 keeping the first group (this budget), 14.03 the first two (needs 15.65
# GiB with arguments and outputs: at the chip's edge), 18.76 all four; docs/memory.md)
KEEP = 1 << 29
# what a split call's parts are: ``"heads"``, groups of consecutive heads over every query (the
# measured path, docs/benchmarks_tpu.md), or ``"queries"``, chunks of consecutive queries with
# every head, so that a query's picked rows are fetched once for all its heads rather than once
# per group (the same memory: a chunk's arrays are a group's; compiled for a v5e, its chip A/B
# prepared: ``benchmarks.layer_ab --variants query-chunks``; docs/kernels.md, "V3.2 since issue
# 54"); queries where the sequence does not split into equal chunks run in head groups
SPLIT = "heads"


def kept_parts(shape: tuple[int, ...], parts: int, width: int) -> int:
    """**Arguments:** the per-head queries' ``shape`` ``[B, S, H, d]``, the number of ``parts``
    the call is split into and the latent values' ``width``.

    **Returns:** how many parts keep their kernel's latent output (``[B, S, H, width]`` /
    ``parts`` elements each) for the backward (``in_parts``' ``keep``): as many as fit ``KEEP``
    elements."""
    b, s, heads, _ = shape
    return min(parts, KEEP // max(b * s * heads * width // parts, 1))


def head_groups(shape: tuple[int, ...], width: int) -> int:
    """**Arguments:** the per-head queries' ``shape`` ``[B, S, H, d]`` and the latent keys'
    ``width``.

    **Returns:** 1 where the absorbed queries fit ``ONE_CALL``, else the fewest head groups (a
    power of two dividing ``H``, at least 16 heads each: a bfloat16 kernel's head block) of at
    most ``GROUP`` elements each."""
    b, s, heads, _ = shape
    if b * s * heads * width <= ONE_CALL:
        return 1
    groups = 1
    while b * s * (heads // groups) * width > GROUP and heads % (groups * 2) == 0:
        if heads // (groups * 2) < 16:
            break
        groups *= 2
    return groups


def query_chunks(shape: tuple[int, ...], width: int) -> int:
    """**Arguments:** as ``head_groups``'.

    **Returns:** 1 where the absorbed queries fit ``ONE_CALL``, else the fewest chunks of
    consecutive queries (a power of two dividing ``S``) of at most ``GROUP`` elements each, or
    0 where ``S`` has no such split."""
    b, s, heads, _ = shape
    if b * s * heads * width <= ONE_CALL:
        return 1
    chunks = 1
    while b * (s // chunks) * heads * width > GROUP:
        if s % (chunks * 2):
            return 0
        chunks *= 2
    return chunks


def split_of(shape: tuple[int, ...], width: int) -> tuple[str, int]:
    """**Returns:** how a call of per-head queries of ``shape`` ``[B, S, H, d]`` over latent
    keys ``width`` wide runs: ``(SPLIT, parts)`` (``head_groups`` or ``query_chunks``; one part:
    one call), in head groups where ``SPLIT`` is ``"queries"`` but ``query_chunks`` finds no
    split."""
    if SPLIT == "queries" and (chunks := query_chunks(shape, width)):
        return "queries", chunks
    return "heads", head_groups(shape, width)


def in_parts(attend, parts: int, split: tuple, fixed: tuple, shared: tuple, keep: int = 0):
    """``attend(split, fixed, shared, saved) -> ((out, lse or None), kept)`` over ``parts``
    parts in turn (``lax.map``): ``split`` (float arrays, differentiated) and ``fixed`` (int
    arrays) stacked on a leading axis of ``parts``, ``shared`` the same for every part (V3.2's
    head groups: the groups' queries and ``kv_b_proj`` rows split, the latent keys shared; its
    query chunks: the chunks' queries split, their query rows and picks fixed, ``kv_b_proj`` and
    the keys shared). Its backward runs part by part, in the same order (a ``custom_vjp``: it
    keeps the first parts' kernel outputs and recomputes the others', which no
    ``jax.checkpoint`` policy over one ``lax.map`` says): one part's absorbed queries and kernel
    buffers are live at a time. ``attend`` is called with ``saved=None`` in the forward;
    ``kept`` is what it keeps of a part for the backward (``V32Attention`` with a kernel that
    can ``replay``: the kernel's latent output and ``lse``), or ``None``. The first ``keep``
    parts' ``kept`` is saved: the backward calls ``attend`` again with it as ``saved``
    (differentiated: the backward kernel on the kept outputs, no forward kernel), first, so
    the kept outputs are gone before the other parts' forward is recomputed there
    (``saved=None``). ``shared``'s gradients are the parts' summed in float32, in part order.

    **Returns:** ``(out, lse or None)``, stacked on the leading axis of ``parts``."""

    def halves(tree):  # the kept parts, the recomputed ones
        return jax.tree.map(lambda a: a[:keep], tree), jax.tree.map(lambda a: a[keep:], tree)

    def mapped(xs, shared, keeping: bool):
        def one(a):
            out, kept = attend(*a, shared, None)
            return (out, kept) if keeping else out

        return jax.lax.map(one, xs)

    @jax.custom_vjp
    def run(split, fixed, shared):
        return mapped((split, fixed), shared, False)

    def forward(split, fixed, shared):
        saved, recomputed = halves((split, fixed))
        outs, kept = [], None
        if keep:
            out, kept = mapped(saved, shared, True)
            outs.append(out)
        if keep < parts:
            outs.append(mapped(recomputed, shared, False))
        out = outs[0] if len(outs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
        return out, (split, fixed, shared, kept)

    def backward(residuals, grads):
        split, fixed, shared, kept = residuals

        def part(d_shared, a):
            xs, ints, saved, g = a
            _, vjp = jax.vjp(lambda xs, sh: attend(xs, ints, sh, saved)[0], xs, shared)
            d_xs, d_part = vjp(g)
            summed = jax.tree.map(lambda d, p: d + p.astype(jnp.float32), d_shared, d_part)
            return summed, d_xs

        saved, recomputed = halves((split, fixed, grads))
        # the carry varies as the parts' gradients will (inside a check_vma shard_map)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shared)
        d_shared = varying_like(zeros, split, shared, grads)
        ds = []
        if keep:
            xs, ints, g = saved
            d_shared, d = jax.lax.scan(part, d_shared, (xs, ints, kept, g))
            ds.append(d)
        if keep < parts:
            xs, ints, g = recomputed
            d_shared, d = jax.lax.scan(part, d_shared, (xs, ints, None, g))
            ds.append(d)
        d = ds[0] if len(ds) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *ds)
        d_shared = jax.tree.map(lambda d, a: d.astype(a.dtype), d_shared, shared)
        return d, None, d_shared

    run.defvjp(forward, backward)
    return run(split, fixed, shared)


def split_call(
    attend, split: str, parts: int, q_nope, q_rope, weight, keys, visibility, picks, keep: int
):
    """``attend(q_nope, q_rope, weight, keys, visibility, picks, saved) -> ((out, lse or None),
    kept)`` over the ``parts`` of ``split`` (``split_of``; ``in_parts``: ``keep`` parts keep
    their kernel outputs) of the per-head queries ``q_nope`` and ``q_rope`` ``[B, S, H, d]``,
    ``kv_b_proj`` (``weight``, head-major rows), the latent ``keys``, the queries'
    ``visibility`` and ``picks`` (``[B, S, k]`` or ``None``).

    **Returns:** ``(out [B, S, H, v], lse [B, S, H] or None)``, the parts' joined."""
    if split == "heads":
        axis, fixed, shared = 2, (), (keys,)
        split_args = (q_nope, q_rope)
    else:
        axis, shared = 1, (weight, keys)
        rows = (visibility.query_index, visibility.query_segment)
        fixed, split_args = rows + (() if picks is None else (picks,)), (q_nope, q_rope)

    def cut(a):  # [..., n, ...] at ``axis`` -> [parts, ..., n / parts, ...]
        return jnp.moveaxis(a.reshape(*a.shape[:axis], parts, -1, *a.shape[axis + 1 :]), axis, 0)

    def join(a):
        a = jnp.moveaxis(a, 0, axis)
        return a.reshape(*a.shape[:axis], -1, *a.shape[axis + 2 :])

    def part(xs, ints, shared, saved):
        if split == "heads":
            return attend(*xs, *shared, visibility, picks, saved)
        qi, segment, *pk = ints
        seen = visibility._replace(query_index=qi, query_segment=segment)
        return attend(*xs, *shared, seen, pk[0] if pk else None, saved)

    # the shared arrays vary as the queries do (inside a check_vma shard_map: their summed
    # cotangents vary, and JAX's own transpose of this cast sums a replicated one's)
    shared = varying_like(shared, split_args)
    xs = tuple(map(cut, split_args))
    if split == "heads":
        xs += (weight.reshape(parts, -1, weight.shape[-1]),)
    return jax.tree.map(join, in_parts(part, parts, xs, tuple(map(cut, fixed)), shared, keep))


def replaying(attention, numerics, up: LatentUp, dtype):
    """**Returns:** the kernel ``attention`` runs the MLA ``up`` with (``AutoAttention``'s
    choice for queries of ``dtype``) where it can ``replay`` (its forward's outputs kept, its
    backward run on them: ``MosaicAttention.replay``) and computes ``latent`` as
    ``AbstractAttentionKernel``'s absorbed form does; else ``None``."""
    kernel = resolved(attention, numerics, up, dtype)
    if hasattr(kernel, "replay") and type(kernel).latent is AbstractAttentionKernel.latent:
        return kernel
    return None


class V32Attention(AbstractIndexedAttention):
    """One DeepSeek-V3.2 attention layer (MLA + DSA).

    Parameters use the HF module's names and torch's ``[out, in]`` layout (``k_norm_bias`` holds
    ``indexer.k_norm.bias``), so ``csa_eqx.hf.load_v32_attention`` is a plain copy. Every
    projection goes through the numerics' ``linear``; under ``DeepSeekInference`` a loader keeps
    an FP8 checkpoint's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
    ``o_proj``, ``indexer.wq_b`` and ``indexer.wk`` as ``Fp8Weight`` (the absorbed form
    dequantises ``kv_b_proj``, as DeepSeek's decode does). Its attention is the execution's
    kernel's MLA (``AbstractAttentionKernel.latent``): absorbed, or under ``DeepSeekInference``
    DeepSeek's expanded prefill (``ExpandedAttention``, ``AutoAttention``'s choice).

    **Arguments:** ``config`` (a ``V32AttentionConfig``), ``key``, ``dtype``, ``execution``, as in
    ``csa_eqx.AbstractIndexedAttention``.
    """

    q_a_proj: Float[Array, "q_lora hidden"] | Fp8Weight
    q_a_layernorm: Float[Array, " q_lora"]
    q_b_proj: Float[Array, "heads_x_qk q_lora"] | Fp8Weight
    kv_a_proj_with_mqa: Float[Array, "kv_lora_plus_rope hidden"] | Fp8Weight
    kv_a_layernorm: Float[Array, " kv_lora"]
    kv_b_proj: Float[Array, "heads_x_kv kv_lora"] | Fp8Weight
    o_proj: Float[Array, "hidden heads_x_v"] | Fp8Weight
    indexer: V32Indexer
    config: V32AttentionConfig = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V32_FORMATS

    def __init__(
        self, config: V32AttentionConfig, *, key: Array, dtype=jnp.float32, execution=None
    ):
        """A randomly initialised layer (``csa_eqx.hf`` loads weights): ``config``, PRNG
        ``key``, parameter ``dtype`` (norms stay float32) and ``execution`` (``None``:
        automatic), as ``AbstractIndexedAttention`` says."""
        c = config
        execution = Execution.checked(execution, c, V32_FORMATS)
        ks = jax.random.split(key, 6)
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.q_a_proj = init_linear(ks[0], c.q_lora_rank, c.hidden_size, dtype)
        self.q_a_layernorm = jnp.ones((c.q_lora_rank,), jnp.float32)
        self.q_b_proj = init_linear(ks[1], c.num_heads * qk, c.q_lora_rank, dtype)
        self.kv_a_proj_with_mqa = init_linear(
            ks[2], c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size, dtype
        )
        self.kv_a_layernorm = jnp.ones((c.kv_lora_rank,), jnp.float32)
        self.kv_b_proj = init_linear(
            ks[3], c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, dtype
        )
        self.o_proj = init_linear(ks[4], c.hidden_size, c.num_heads * c.v_head_dim, dtype)
        self.indexer = V32Indexer(c, key=ks[5], dtype=dtype)
        self.config = config
        self.execution = execution

    @property
    def softmax_scale(self) -> float:
        """``(d_nope + d_rope)^-1/2``, times YaRN's ``mscale²`` when the config uses YaRN."""
        c = self.config
        return (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5 * yarn_mscale(c.rope_scaling) ** 2

    def _project(self, x, positions) -> tuple[Array, Array, Array, Array]:
        """**Arguments:** ``x [B, S, hidden]`` and int32 RoPE ``positions [B, S]``.

        **Returns:** the query latent ``qr [B, S, q_lora_rank]``, the per-head query parts
        ``q_nope [B, S, H, d_nope]`` and ``q_rope [B, S, H, d_rope]``, and the shared per-token
        key ``[c_kv ; k_rope]`` ``[B, S, kv_lora_rank + qk_rope_head_dim]`` (its first
        ``kv_lora_rank`` channels are the value; as the numerics round it)."""
        c, nx = self.config, self.execution.numerics
        b, s, _ = x.shape
        inv_freq, rope_factor = yarn_table(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        qr = rms_norm(nx.linear(x, self.q_a_proj), self.q_a_layernorm, c.rms_norm_eps)
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q = nx.linear(qr, self.q_b_proj).reshape(b, s, -1, qk)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        q_rope = apply_rope_interleaved(q_rope, positions[..., None], inv_freq) * rope_factor

        latent = nx.linear(x, self.kv_a_proj_with_mqa)
        c_kv = rms_norm(latent[..., : c.kv_lora_rank], self.kv_a_layernorm, c.rms_norm_eps)
        k_rope = apply_rope_interleaved(latent[..., c.kv_lora_rank :], positions, inv_freq)
        keys = jnp.concatenate([c_kv, round_to(k_rope * rope_factor, c_kv.dtype)], axis=-1)
        # the latent as the numerics round it before it is cached and read (DeepSeek's FP8 KV)
        keys = nx.kv(keys, c.qk_rope_head_dim, self.formats)
        return qr, q_nope, round_to(q_rope, q.dtype), keys

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism over ``axis``: the rows of ``q_b_proj`` and ``kv_b_proj`` (per-head
        queries and up-projections) and ``o_proj``'s input columns are split; every other
        array (the MLA latent, the indexer) is replicated. See
        ``AbstractIndexedAttention.head_specs``."""
        specs = split_specs(
            {"q_b_proj": P(axis, None), "kv_b_proj": P(axis, None), "o_proj": P(None, axis)}
        )
        return specs, {"num_heads": self.config.num_heads}

    @property
    def selects(self) -> bool:
        """**Returns:** ``True``: the MLA reads the tokens its indexer selects."""
        return True

    @property
    def entry_rate(self) -> int:
        """**Returns:** 1 (every token is an entry the indexer selects among)."""
        return 1

    def summary(self) -> tuple[str, dict[str, int]]:
        """See ``AbstractIndexedAttention.summary``: the indexer's ``index_topk`` and heads,
        the MLA's heads, latent rank and the hidden size."""
        sizes = ("index_topk", "index_n_heads", "num_heads", "kv_lora_rank", "hidden_size")
        return "DSA (MLA + lightning indexer over tokens)", config_sizes(self.config, *sizes)

    @property
    def context_halo(self) -> int:
        """**Returns:** 0: a chunk's rows need nothing of the rows before them but their keys,
        which context parallelism all-gathers (``Rows.gather``)."""
        return 0

    def forward_rows(self, x, source, stage, want_loss=False):
        """The pipeline over ``source`` (see ``AbstractIndexedAttention.forward_rows``): sparse
        MLA over the tokens the indexer selects (docs/concepts.md, "DeepSeek-V3.2 DSA"); in
        the ``"dense"`` stage, the warm-up: plain causal MLA over every earlier token of the
        segment. Every token is its own entry: under context parallelism the rows' MLA latents
        and indexer keys are all-gathered into the whole sequence's; ``extend`` appends them
        to the cache's. The attention is the execution's kernel's MLA (``latent``)."""
        c, ex = self.config, self.execution
        positions, nx = source.positions, ex.numerics
        qr, q_nope, q_rope, keys = self._project(x, positions)
        # the selection ignores gradients and the loss must train the indexer only, never x
        index_keys = nx.indexer(
            self.indexer.keys(jax.lax.stop_gradient(x), positions, nx), self.formats
        )
        keys, layout, source = source.tokens("latent", keys)
        index_keys, _, source = source.tokens("index_keys", index_keys)
        keys = keys.astype(q_nope.dtype)
        visibility = Visibility(source.query_index, source.segment, layout)
        given = (x, qr, positions, index_keys, visibility, ex, self.formats)
        selection, problem, _ = self.indexer(*given)
        picks = None if stage == "dense" else selection
        expanded = nx.expanded_attention(self.formats)
        up = LatentUp(self.kv_b_proj, c.qk_nope_head_dim, c.v_head_dim, expanded)
        kernel = dict(numerics=nx, query_block=ex.query_block, tiles=ex.tiles)

        shape, width = q_nope.shape, keys.shape[-1]
        one = isinstance(self.kv_b_proj, Fp8Weight)
        split, parts = ("heads", 1) if one else split_of(shape, width)
        replays = replaying(ex.attention, nx, up, q_nope.dtype)

        def attend(q_nope, q_rope, weight, keys, seen=visibility, picks=picks, saved=None):
            """The attention of queries ``seen`` (a part's: ``split_call``) over their
            ``picks``: ``((out, lse or None), kept)``. Split, with a kernel that can
            ``replay``: the absorbed MLA of ``AbstractAttentionKernel.latent`` step by step,
            keeping the kernel's latent output and ``lse`` (``saved``: the part's kept ones,
            replayed); else the kernel's ``latent``, nothing kept."""
            reads = entry_reads(ex.picks, keys, seen, picks, value_width=c.kv_lora_rank)
            up = LatentUp(weight, c.qk_nope_head_dim, c.v_head_dim, expanded)
            if replays is None or parts == 1:
                out = ex.attention.latent(
                    q_nope, q_rope, reads, up, self.softmax_scale, return_lse=want_loss, **kernel
                )
                return (out if want_loss else (out, None)), None
            q = up.absorb(q_nope, q_rope)
            if saved is None:
                o, lse = replays(q, reads, None, self.softmax_scale, return_lse=True, **kernel)
            else:
                o, lse = replays.replay(q, reads, None, self.softmax_scale, *saved, numerics=nx)
            return (up.values(o), lse if want_loss else None), (o, lse)

        if parts == 1:
            (o, lse), _ = attend(q_nope, q_rope, self.kv_b_proj, keys)
        else:
            keep = 0 if replays is None else kept_parts(shape, parts, c.kv_lora_rank)
            given = (q_nope, q_rope, self.kv_b_proj, keys, visibility, picks, keep)
            o, lse = split_call(attend, split, parts, *given)
        y = nx.linear(o.reshape(*o.shape[:2], -1), self.o_proj)
        target = None
        if want_loss:  # KL distillation against the absorbed MLA queries and keys attended
            target = AttentionTarget(up.absorb(q_nope, q_rope), keys, lse, self.softmax_scale)
        return Forward(y, selection, problem, target, source, {})

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V32Cache:
        """An empty decode cache of fixed-size buffers.

        **Arguments:**

        - ``batch_size``: rows decoded at once.
        - ``max_length``: tokens per row the cache can hold.
        - ``dtype``: dtype of the cached latents and indexer keys.

        **Returns:**

        A ``csa_eqx.V32Cache`` (``length`` 0 in every row).
        """
        c = self.config
        check_cache_size(batch_size, max_length)
        length, position, segment = empty_rows(batch_size)
        latent = c.kv_lora_rank + c.qk_rope_head_dim
        return V32Cache(
            length=length,
            position=position,
            segment=segment,
            latent=jnp.zeros((batch_size, max_length, latent), dtype),
            index_keys=jnp.zeros((batch_size, max_length, c.index_head_dim), dtype),
            token_segment=jnp.full((batch_size, max_length), -1, jnp.int32),
            max_length=max_length,
        )
