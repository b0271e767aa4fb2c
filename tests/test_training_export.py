"""The trainer's export (training/export.py): names, dtypes and packing from the checkpoint table, a
written checkpoint read back bit for bit. Skips without torch."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_training_model import small_config  # noqa: E402

from kimi_explore import KimiDecoderConfig  # noqa: E402
from kimi_explore.weights import checkpoint_table as table  # noqa: E402
from training.export import load_exported, released_tensors, round_to_released, save  # noqa: E402
from training.model import KimiK3  # noqa: E402


@pytest.fixture(scope="module")
def rounded():
    torch.manual_seed(0)
    model = KimiK3(small_config())
    with torch.no_grad():  # the router bias is a zero buffer at init: give it values that rounding would change
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.copy_(torch.randn(m.E) * 0.1)
    before = copy.deepcopy(model)
    round_to_released(model)
    return before, model


def test_rounding_follows_the_tables_disk_dtypes(rounded):
    before, after = rounded
    tc = KimiDecoderConfig.from_dict(after.text_config)
    dtype = {t.name: t.dtype for t in table.plan(tc)}
    a = dict(before.named_parameters()) | dict(before.named_buffers())
    b = dict(after.named_parameters()) | dict(after.named_buffers())
    checked = set()
    for name, p in a.items():
        q = b[name]
        if name.endswith(("block_sparse_moe.w1", "block_sparse_moe.w2", "block_sparse_moe.w3")):
            assert not torch.equal(p, q), name  # MXFP4: 4-bit values
            assert torch.equal(q, q.to(torch.bfloat16).to(torch.float32)), name
            checked.add("MXFP4")
        elif dtype[name] == table.F32:
            assert torch.equal(p, q), name  # kept in float32 on disk
            checked.add("F32")
        else:
            assert dtype[name] == table.BF16 and torch.equal(q, p.to(torch.bfloat16).to(torch.float32)), name
            checked.add("BF16")
    assert checked == {"MXFP4", "F32", "BF16"}


def test_a_written_checkpoint_reads_back_bit_for_bit(rounded, tmp_path):
    _, model = rounded
    path = save(model, tmp_path / "ckpt", shards=2)
    back = load_exported(path)
    sd, got = model.state_dict(), back.state_dict()
    assert sorted(sd) == sorted(got)
    for name in sd:
        assert torch.equal(sd[name], got[name]), name
    assert back.text_config == model.text_config
    # the written names are the table's, experts split per expert
    names = released_tensors(model)
    assert sorted(names) == sorted(t.name for t in table.plan(model.cfg))
    w1 = model.model.layers[1].block_sparse_moe.w1.detach().numpy()
    np.testing.assert_array_equal(names["model.layers.1.block_sparse_moe.experts.3.w1.weight"], w1[3])


def test_a_parameter_the_table_does_not_know_is_an_error():
    model = KimiK3(small_config())
    model.model.layers[0].extra = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match=r"not in the table \['model.layers.0.extra.weight'\]"):
        released_tensors(model)
