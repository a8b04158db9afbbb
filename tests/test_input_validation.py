"""Bad input to the layers' public calls gets an error naming the argument, the expected and the
actual value, before any compute; empty inputs get empty outputs (``csa_eqx._checks``). Every
layer kind behaves alike (one protocol): V4, V3.2 and V4.1 layers (a KV source, a reuse layer,
a sliding one), the V4.1 ones also with the published state (``shared=``).

The test session type-checks every ``csa_eqx`` function (``--jaxtyping-packages``); users get
that only on ``__call__`` (``@jaxtyped``), so the ``extend`` tests switch it off to see what a
user sees.
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import csa_eqx
from csa_eqx.presets import tiny_v4, tiny_v32

CONFIGS = {"csa": tiny_v4("csa"), "sliding": tiny_v4("sliding"), "v32": tiny_v32()}
# a V4.1 stack at the tiny layers' sizes: a KV source, a reuse layer, a sliding layer
V41 = csa_eqx.V41AttentionConfig(
    compress_ratios=(2, 2, 0),
    kv_source_layers=(0,),
    index_source_layers=(0,),
    **{k: getattr(tiny_v4("csa"), k) for k in ("hidden_size", "num_heads", "head_dim")},
    rope_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=8,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=4,
)
V41_LAYERS = {"v41": 0, "v41-reuse": 1, "v41-sliding": 2}
NAMES = [*CONFIGS, *V41_LAYERS]
SLIDING = ("sliding", "v41-sliding")


@functools.cache
def _layer(name):
    if name in V41_LAYERS:
        return csa_eqx.V41Attention(V41, V41_LAYERS[name], key=jax.random.key(0))
    cls = csa_eqx.V32Attention if name == "v32" else csa_eqx.V4Attention
    return cls(CONFIGS[name], key=jax.random.key(0))


EXTEND = eqx.filter_jit(lambda m, x, c, **kw: m.extend(x, c, **kw))
X = jnp.ones((2, 8, 64))  # tiny layers: hidden 64
NON_CONTIGUOUS = jnp.array([[0, 0, 1, 1, 0, 0, 2, 2], [0] * 8])


def _raises(error, *fragments):
    """``pytest.raises`` whose message must contain every fragment (literally)."""
    return pytest.raises(error, match="(?s)" + ".*".join(re.escape(f) for f in fragments))


@pytest.fixture(params=["csa", "v32", "v41"])
def layer(request):
    return _layer(request.param)


@pytest.fixture
def no_hook():
    """What a user calling ``extend`` sees: no jaxtyping checks on ``csa_eqx`` internals."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


# ---- forward ----------------------------------------------------------------------------


def test_forward_hidden_size_is_named_with_its_value(layer):
    with _raises(
        ValueError, "x must have shape [batch, seq, 64]", "config.hidden_size", "(2, 8, 63)"
    ):
        layer(X[..., :63])


def test_forward_integer_x_names_the_argument(layer):
    with _raises(TypeCheckError, "parameter 'x'", "i32[2,8,64]", "Float"):
        layer(X.astype(jnp.int32))


def test_forward_rejects_non_contiguous_segments(layer):
    with _raises(ValueError, "segment_ids must be contiguous runs", "row 0: [0 0 1 1 0 0 2 2]"):
        layer(X, segment_ids=NON_CONTIGUOUS)


def test_forward_rejects_negative_segments(layer):
    with _raises(ValueError, "segment_ids must be >= 0", "row 1: [ 0  0  0  0 -1 -1 -1 -1]"):
        layer(X, segment_ids=jnp.array([[0] * 8, [0] * 4 + [-1] * 4]))


def test_forward_segment_checks_run_inside_jit(layer):
    call = eqx.filter_jit(lambda m, x, s: m(x, segment_ids=s))
    with _raises(eqx.EquinoxRuntimeError, "segment_ids must be contiguous runs"):
        call(layer, X, NON_CONTIGUOUS)
    ok = jnp.array([[3, 3, 1, 1, 0, 0, 2, 2], [5] * 8])  # ids in any order, each one run
    assert call(layer, X, ok).shape == X.shape


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(2, 0, 64), (0, 8, 64)], ids=["no-tokens", "no-rows"])
def test_forward_empty_input_gives_empty_output(name, shape):
    layer = _layer(name)
    y, aux = layer(jnp.zeros(shape), return_aux=True)
    assert y.shape == shape and y.dtype == jnp.float32
    published = csa_eqx.V41Shared(selection=jnp.zeros((2, 8, 4), jnp.int32))
    y_shared, back = layer(jnp.zeros(shape), shared=published)  # the state comes back as it was
    assert back is published and y_shared.shape == shape
    if name in SLIDING:
        assert aux["selection"] is None
    else:
        assert aux["selection"].shape == (*shape[:2], layer.config.index_topk)
    assert layer(jnp.zeros(shape)).shape == shape


# ---- extend -----------------------------------------------------------------------------


def test_extend_rejects_integer_x(layer, no_hook):
    with _raises(TypeError, "x must be a floating-point array", "int32"):
        layer.extend(X.astype(jnp.int32), layer.init_cache(2, 32))


@pytest.mark.parametrize(
    "x, shown",
    [(X[0], "(8, 64)"), (X[..., :3], "(2, 8, 3)")],
    ids=["rank-2", "hidden"],
)
def test_extend_rejects_bad_x_shape(layer, no_hook, x, shown):
    with _raises(ValueError, "x must have shape [batch, seq, 64]", shown):
        layer.extend(x, layer.init_cache(2, 32))


def test_extend_batch_must_match_the_cache(layer, no_hook):
    with _raises(ValueError, "x must have the cache's batch size 2", "(1, 8, 64)"):
        layer.extend(X[:1], layer.init_cache(2, 32))


def test_extend_cache_must_come_from_the_layer(no_hook):
    csa, sliding = _layer("csa"), _layer("sliding")
    with _raises(TypeError, "cache must come from this layer's init_cache", "sliding"):
        sliding.extend(X, csa.init_cache(2, 32))
    with _raises(TypeError, "V32Cache", "got a V4Cache"):
        _layer("v32").extend(X, csa.init_cache(2, 32))


def test_extend_lengths_type_shape_and_range(layer, no_hook):
    cache = layer.init_cache(2, 32)
    with _raises(TypeError, "lengths must be an integer array", "float32"):
        layer.extend(X, cache, lengths=jnp.array([1.0, 2.0]))
    with _raises(ValueError, "lengths must have shape [batch] = (2,)", "(3,)"):
        layer.extend(X, cache, lengths=jnp.array([1, 2, 3]))
    for bad in ([1, 9], [-1, 2]):
        with _raises(ValueError, "lengths must be in 0..8", str(np.array(bad))):
            layer.extend(X, cache, lengths=jnp.array(bad))
    with _raises(eqx.EquinoxRuntimeError, "lengths must be in 0..8"):
        EXTEND(layer, X, cache, lengths=jnp.array([1, 9]))


def test_extend_segment_ids(layer, no_hook):
    cache = layer.init_cache(2, 32)
    with _raises(ValueError, "segment_ids must have shape [batch, chunk] = (2, 8)", "(2, 7)"):
        layer.extend(X, cache, segment_ids=jnp.zeros((2, 7), jnp.int32))
    with _raises(ValueError, "segment_ids must be >= 0", "row 0: [-1 -1 -1 -1 -1 -1 -1 -1]"):
        layer.extend(X, cache, segment_ids=-jnp.ones((2, 8), jnp.int32))
    with _raises(ValueError, "contiguous runs", "row 0: [0 0 1 1 0 0 2 2]"):
        layer.extend(X, cache, segment_ids=NON_CONTIGUOUS)
    # padded tokens (beyond lengths) may carry anything
    padded = jnp.array([[0, 0, 1, 1, 1, 1, -1, 0]] * 2)
    y, cache = EXTEND(layer, X, cache, lengths=jnp.array([6, 6]), segment_ids=padded)
    assert np.isfinite(np.asarray(y[:, :6])).all()
    # after documents 0 and 1: continuing 1 or starting 2 is fine, coming back to 0 is not
    for ok in (1, 2):
        EXTEND(layer, X[:, :1], cache, segment_ids=jnp.full((2, 1), ok))
    with _raises(ValueError, "contiguous runs", "across chunks", "row 0: [0]"):
        layer.extend(X[:, :1], cache, segment_ids=jnp.zeros((2, 1), jnp.int32))
    with _raises(eqx.EquinoxRuntimeError, "contiguous runs"):
        EXTEND(layer, X[:, :1], cache, segment_ids=jnp.zeros((2, 1), jnp.int32))


@pytest.mark.parametrize("name", NAMES)
def test_extend_empty_chunk_changes_nothing(name, no_hook):
    layer = _layer(name)
    if name == "v41-reuse":  # its source's chunk first: it reads what that publishes
        source = _layer("v41")
        shared = EXTEND(source, X, source.init_cache(2, 32), shared=csa_eqx.V41Shared())[2]
        cache = EXTEND(layer, X, layer.init_cache(2, 32), shared=shared)[1]
    else:
        cache = EXTEND(layer, X, layer.init_cache(2, 32))[1]
    y, after, aux = layer.extend(X[:, :0], cache, return_aux=True)
    assert y.shape == (2, 0, 64)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), cache, after))
    given = csa_eqx.V41Shared()
    assert layer.extend(X[:, :0], cache, shared=given)[2] is given
    if name in SLIDING:
        assert aux["selection"] is None
    else:
        assert aux["selection"].shape == (2, 0, layer.config.index_topk)


@pytest.mark.parametrize("name", ["csa", "v32", "v41"])
def test_extend_refuses_a_split_execution(name):
    """``extend`` decodes on one device: an execution with head or context parallelism is
    refused with the way out, not silently run on one device."""
    layer = _layer(name)
    for split in (dict(heads=csa_eqx.HeadParallel()), dict(context=csa_eqx.ContextParallel())):
        split_layer = layer.with_execution(csa_eqx.Execution(**split))
        with _raises(ValueError, "extend runs on one device", "=None"):
            split_layer.extend(X, split_layer.init_cache(2, 32))


# ---- what a person reads: the named check's line first (issue 46) -----------------------


def _first_line(error, call):
    """The first line of the message of the ``error`` that ``call()`` raises."""
    with pytest.raises(error) as caught:
        call()
    return str(caught.value).splitlines()[0]


@pytest.mark.parametrize(
    "kwargs, error, line",
    [
        (
            dict(x=X.astype(jnp.int32)),
            TypeError,
            "x must be a floating-point array [batch, seq, hidden] (got dtype int32)",
        ),
        (
            dict(x=X[..., :63]),
            ValueError,
            "x must have shape [batch, seq, 64] (hidden = config.hidden_size) "
            "(got shape (2, 8, 63))",
        ),
        (
            dict(positions=jnp.zeros((2, 8), jnp.float32)),
            TypeError,
            "positions must be an integer array [batch, seq] (got dtype float32)",
        ),
        (
            dict(positions=jnp.arange(8)),
            ValueError,
            "positions must have shape [batch, seq] = (2, 8) (got (8,))",
        ),
        (
            dict(segment_ids=jnp.zeros((2, 8), jnp.float32)),
            TypeError,
            "segment_ids must be an integer array [batch, seq] (got dtype float32)",
        ),
        (
            dict(segment_ids=jnp.zeros((8,), jnp.int32)),
            ValueError,
            "segment_ids must have shape [batch, seq] = (2, 8) (got (8,))",
        ),
    ],
    ids=["integer-x", "hidden-size", "float-positions", "1d-positions", "float-ids", "1d-ids"],
)
def test_forward_errors_lead_with_the_named_check(layer, kwargs, error, line):
    """The first line names the argument, what it must be and what came, with jaxtyping on
    (the test session checks every function, as ``@jaxtyped`` does a user's call): the
    named check leads and jaxtyping's account follows."""
    kwargs = {"x": X, **kwargs}
    assert _first_line(error, lambda: layer(**kwargs)) == line


def test_extend_errors_lead_with_the_named_check(layer):
    cache = layer.init_cache(2, 32)
    assert (
        _first_line(TypeError, lambda: layer.extend(X, cache, lengths=jnp.array([1.0, 2.0])))
        == "lengths must be an integer array [batch] (got dtype float32)"
    )
    assert _first_line(TypeError, lambda: layer.extend(X.astype(jnp.int32), cache)) == (
        "x must be a floating-point array [batch, seq, hidden] (got dtype int32)"
    )


# ---- one way to say how a layer runs (issue 46) -----------------------------------------


@pytest.mark.parametrize(
    "options, spelled",
    [
        (dict(context_parallel=True), "Execution.from_options(context_parallel=...)"),
        (dict(indexer_sharded_topk=True), "Execution.from_options(indexer_sharded_topk=...)"),
    ],
)
def test_execution_refuses_a_loader_option_naming_from_options(options, spelled):
    line = _first_line(TypeError, lambda: csa_eqx.Execution(**options))
    assert line.endswith(spelled) and "not a field of Execution" in line, line


@pytest.mark.parametrize(
    "fields, spelled",
    [
        (dict(save_selection=True), "save_selection= is spelled indexer_save_selection= here"),
        (dict(context=csa_eqx.ContextParallel()), "context= is a field: Execution(context=...)"),
    ],
)
def test_from_options_refuses_a_field_naming_its_spelling(fields, spelled):
    line = _first_line(TypeError, lambda: csa_eqx.Execution.from_options(**fields))
    assert line == f"Execution.from_options: {spelled}", line
    # the right spellings run
    assert csa_eqx.Execution.from_options(indexer_save_selection=True).save_selection
    assert csa_eqx.Execution(save_selection=True) == csa_eqx.Execution.from_options(
        indexer_save_selection=True
    )


# ---- value checks under a mesh (issue 46) -----------------------------------------------


def test_value_checks_on_a_mesh_leave_nothing_on_one_device(capfd):
    """A head-parallel layer on a data x tensor mesh, x split over data. Numpy segment ids that
    the jitted call captures are checked when it is traced: no run-time check (host callback)
    in the program, and a bad one raises the named ValueError then. Segment ids passed as an
    argument keep the run-time check, which sends only a scalar from the callback's device: XLA
    reports no involuntary full rematerialization for either program."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    hp = _layer("csa").with_execution(csa_eqx.Execution.from_options(head_parallel=True))
    mesh = jax.make_mesh((2, 2), ("data", "tensor"))
    seg = np.repeat(np.array([[0, 1, 2], [0, 0, 0]]), [3, 2, 3], axis=1)
    bad = seg.copy()
    bad[0, -1] = 0  # document 0 comes back
    capfd.readouterr()
    with jax.set_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        captured = jax.jit(lambda m, x: m(x, segment_ids=seg)).lower(hp, x)
        passed = jax.jit(lambda m, x, s: m(x, segment_ids=s)).lower(hp, x, seg)
        captured.compile(), passed.compile()
        with _raises(ValueError, "segment_ids must be contiguous runs", "row 0: [0 0 0 1 1 2 2 0]"):
            jax.jit(lambda m, x: m(x, segment_ids=bad))(hp, x)
        with _raises(ValueError, "lengths must be in 0..8", "[1 9]"):  # extend, one device
            jax.jit(lambda m, x, c: m.extend(x, c, lengths=np.array([1, 9])))(
                _layer("csa"), X, _layer("csa").init_cache(2, 32)
            )
    assert "callback" not in captured.as_text()
    assert "callback" in passed.as_text()  # the run-time check, for values known only then
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_bf16_layer_with_float32_input_warns_once(monkeypatch):
    """A layer with bfloat16 weights given float32 input computes in float32 (JAX promotes the
    weights): one ``UserWarning`` at trace time naming the layer and the fix, once per layer
    class, from ``__call__`` and ``extend``; bfloat16 input, a float32 layer
    and DeepSeek's numerics (which round the input themselves) warn nothing. Traced only."""
    import warnings

    from csa_eqx import _checks as checks

    monkeypatch.setattr(checks, "_WARNED_DTYPES", set())
    config = tiny_v4("sliding", head_dim=72, index_head_dim=32)  # sizes DeepSeek numerics take
    layer = csa_eqx.V4Attention(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    x = jnp.ones((1, 8, config.hidden_size), jnp.float32)
    with pytest.warns(UserWarning, match=r"^V4Attention's weights are bfloat16 but its input x"):
        assert jax.eval_shape(layer, x).dtype == jnp.float32  # float32 in, float32 out
    deepseek = layer.with_execution(csa_eqx.Execution(numerics=csa_eqx.DeepSeekInference()))
    f32 = csa_eqx.V4Attention(config, key=jax.random.key(0))
    with warnings.catch_warnings():  # the check itself, without tracing a layer again
        warnings.simplefilter("error")
        checks.warn_dtype_mismatch(layer, x)  # warned already
        checks.warn_dtype_mismatch(layer, x.astype(jnp.bfloat16))
        checks._WARNED_DTYPES.clear()
        checks.warn_dtype_mismatch(f32, x)
        checks.warn_dtype_mismatch(deepseek, x)
    checks._WARNED_DTYPES.clear()
    with pytest.warns(UserWarning, match=r"^V4Attention's weights are bfloat16"):
        jax.eval_shape(lambda x: layer.extend(x, layer.init_cache(1, 8)), x[:, :4])
