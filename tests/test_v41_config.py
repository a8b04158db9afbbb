"""V4.1 stack configs: role resolution and the build-time wiring errors (docs/v41.md)."""

import pytest

import csa_eqx as ce

SIZES = dict(
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    rope_dim=8,
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    sliding_window=4,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
)


def config(**kw):
    base = dict(
        compress_ratios=(0, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 5),
        candidate_source_layer=3,
        candidate_topk_blocks=2,
        candidate_block_size=4,
    )
    return ce.V41AttentionConfig(**{**SIZES, **base, **kw})


def test_roles_and_sources():
    c = config()
    assert [c.role(i) for i in range(c.num_layers)] == [
        "sliding",
        "full",
        "reuse",
        "full",
        "reuse",
        "reindex",
        "reuse",
    ]
    assert [c.kv_source(i) for i in range(7)] == [None, 1, 1, 3, 3, 3, 3]
    assert [c.index_source(i) for i in range(7)] == [None, 1, 1, 3, 3, 5, 5]
    assert [c.uses_candidates(i) for i in range(7)] == [False] * 5 + [True, False]
    assert c.is_candidate_source(3) and not c.is_candidate_source(5)


def test_released_schedule_resolves():
    c = ce.V41AttentionConfig(
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
        kv_source_layers=[2, 8, 14, 20],
        index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
        candidate_source_layer=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
    )
    roles = [c.role(i) for i in range(40)]
    assert roles[:3] == ["sliding", "sliding", "full"] and roles[20] == "full"
    assert roles.count("reindex") == 4 and roles.count("full") == 4
    assert c.index_source(27) == 24 and c.kv_source(39) == 20
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_source_layers=(3,), index_source_layers=(3, 5)), "layer 1 .* no KV source"),
        (dict(kv_source_layers=(1,), index_source_layers=(1, 5)), "ratio 1 but reads .* ratio 2"),
        (dict(index_source_layers=(1, 5)), "layer 3 is a KV source but not an index source"),
        (dict(candidate_source_layer=4), "candidate_source_layer 4 is not an index source"),
        (dict(candidate_topk_blocks=1, candidate_block_size=3), "at least index_topk"),
        (dict(candidate_block_size=0), "candidate_block_size must be > 0"),
        (dict(kv_source_layers=(0, 1, 3)), "layer 0 has compress ratio 0"),
        (dict(index_source_layers=(1, 3, 9)), "layer 9 is not in the stack"),
        (dict(index_source_layers=(1, 3, 3)), "increasing distinct"),
        (dict(candidate_source_layer=1, candidate_topk_blocks=4), "index source 3 uses"),
    ],
)
def test_wiring_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_wiring_error_type():
    with pytest.raises(ce.V41WiringError):
        config(kv_source_layers=(3,), index_source_layers=(3, 5))


def test_no_candidates_needs_no_blocks():
    c = config(candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0)
    assert not any(c.uses_candidates(i) for i in range(7))
