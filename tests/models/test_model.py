import torch

from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec


def make(spec=None, seed=0):
    spec = spec or micro_spec()
    return materialize(build_model(spec, "meta"), "cpu", seed=seed)


def test_meta_build_has_no_storage():
    m = build_model(micro_spec(), "meta")
    assert all(p.is_meta for p in m.parameters())


def test_forward_backward_all_params_get_grads(seed):
    spec = micro_spec(index_loss_coef=0.1, aux_loss_coef=0.01, seq_aux_loss_coef=0.01, z_loss_coef=1e-3)
    m = make(spec, seed)
    x = torch.randint(0, 256, (2, 21))
    out = m(x, torch.randint(0, 256, (2, 21)))
    assert out.logits.shape == (2, 21, spec.vocab_size)
    assert torch.isfinite(out.loss) and torch.isfinite(out.aux_loss)
    assert set(out.aux) == {"index_kl", "aux_loss", "seq_aux_loss", "z_loss"}
    assert len(out.moe) == spec.n_layers - spec.first_k_dense
    (out.loss + out.aux_loss).backward()
    no_grad = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == []
    # every MoE layer routed every token to K experts (dropless)
    for s in out.moe:
        assert int(s["counts"].sum()) == 2 * 21 * spec.n_experts_per_tok


def test_causal(seed):
    """Changing future tokens must not change earlier logits (KDA, DSA indexer + sparse attn, MoE)."""
    m = make(seed=seed).eval()
    x = torch.randint(0, 256, (1, 30))
    y = x.clone()
    y[0, 17:] = torch.randint(0, 256, (13,))
    with torch.no_grad():
        a, b = m(x).logits, m(y).logits
    torch.testing.assert_close(a[:, :17], b[:, :17], rtol=1e-5, atol=1e-5)
    assert (a[:, 17:] - b[:, 17:]).abs().max() > 1e-4


def test_plain_moe_and_all_dsa_variants(seed):
    for kw in ({"latent_dim": None}, {"layer_types": ["dsa"] * 4, "q_lora_rank": None, "attn_output_gate": False},
               {"score_func": "softmax", "n_group": 2, "topk_group": 1}, {"tie_word_embeddings": True}):
        m = make(micro_spec(**kw), seed)
        out = m(torch.randint(0, 256, (1, 12)), torch.randint(0, 256, (1, 12)))
        out.loss.backward()
        assert torch.isfinite(out.loss)


def test_seq_len_limit_message():
    m = make(micro_spec(max_position_embeddings=16))
    try:
        m(torch.zeros(1, 17, dtype=torch.long))
    except ValueError as e:
        assert "exceeds max_position_embeddings=16" in str(e)
    else:
        raise AssertionError("no error")
