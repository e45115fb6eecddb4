"""``KFACOptimizer.for_model`` on the model classes of HuggingFace ``transformers``, as a user
would call it: each tiny model built from a config (nothing downloaded), trained with its own
``labels`` loss, and what the default decided checked against the model's structure."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 48, 8


def _ids(batch: int = 4) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(1))


def _train(model: nn.Module, steps: int = 2, **batch: Any) -> KFACOptimizer:
    opt = KFACOptimizer.for_model(model)
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return opt


def _orthogonal(opt: KFACOptimizer) -> set[str]:
    return {r["name"] for r in opt.preconditioner.describe() if "orthogonal" in (r["method"] or "")}


def test_gpt2_orthogonalises_its_conv1d_matrices_as_muon_splits_them() -> None:
    """GPT-2's projections are ``transformers``' ``Conv1D``, not ``nn.Linear``: they are its
    hidden matrices, so ``role:hidden`` orthogonalises them; the position embedding and the
    head (tied to the token embedding) keep the unorthogonalised update."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = _ids()
    opt = _train(model, input_ids=ids, labels=ids)
    conv1d = {
        name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"
    }  # c_attn, c_proj, c_fc, c_proj of each block
    assert len(conv1d) == 8
    assert _orthogonal(opt) == conv1d
    assert set(opt.preconditioner.layers) == conv1d | {"transformer.wpe", "lm_head"}
    roles = {r["name"]: r["role"] for r in opt.preconditioner.describe()}
    assert {roles[name] for name in conv1d} == {"hidden"}
    assert (roles["transformer.wpe"], roles["lm_head"]) == ("embedding", "head")


def _declined(opt: KFACOptimizer) -> dict[str, str]:
    return {
        r["name"]: r["reason"]
        for r in opt.preconditioner.describe()
        if r["block"] == "inner optimizer" and "overrides nn.Embedding.forward" in r["reason"]
    }


def test_bart_learned_positions_are_left_to_adam_not_read_from_the_token_ids() -> None:
    """BART's position embedding is called with the token ids and looks up ``arange(T) + 2``:
    a factor built from its input would count token ids as positions (and fail where the
    vocabulary is larger than the table). It is declined, named with its reason, and the
    model trains."""
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config)
    assert model.model.encoder.embed_positions.num_embeddings < VOCAB
    ids = _ids()
    opt = _train(model, input_ids=ids, labels=ids.flip(1).contiguous())
    assert set(_declined(opt)) == {
        "model.encoder.embed_positions.weight",
        "model.decoder.embed_positions.weight",
    }
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert rows["model.encoder.embed_positions.weight"]["method"] == "adam"


def test_opt_learned_positions_are_not_read_from_the_attention_mask() -> None:
    """OPT's position embedding is called with the attention mask (0s and 1s): a factor of
    its input would silently count two rows of the table. It is declined."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
        num_attention_heads=2, max_position_embeddings=LENGTH, word_embed_proj_dim=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.OPTForCausalLM(config)
    ids = _ids()
    opt = _train(model, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert set(_declined(opt)) == {"model.decoder.embed_positions.weight"}
    assert "model.decoder.embed_positions" not in opt.preconditioner.layers


def test_a_vision_transformers_patch_layer_is_its_input_layer() -> None:
    """CLIP's vision tower has a position ``nn.Embedding`` after its patch convolution: the
    convolution still reads the pixels, so it is the input layer (Adam's update, as Muon
    leaves it), not a hidden matrix; the projection is the head."""
    config = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4, projection_dim=8,
    )  # fmt: skip
    model = transformers.CLIPVisionModelWithProjection(config)
    opt = KFACOptimizer.for_model(model)
    pixels = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        opt.zero_grad()
        model(pixel_values=pixels).image_embeds.pow(2).mean().backward()
        opt.step()
    patch, projection = "vision_model.embeddings.patch_embedding", "visual_projection"
    roles = {r["name"]: r["role"] for r in opt.preconditioner.describe()}
    assert (roles[patch], roles[projection]) == ("input", "head")
    layers = set(opt.preconditioner.layers)
    assert {patch, projection} <= layers
    hidden = layers - {patch, projection, "vision_model.embeddings.position_embedding"}
    assert _orthogonal(opt) == hidden
    assert len(hidden) == 6  # q, k, v, out, fc1, fc2


def test_a_tokenizers_vocabulary_is_left_to_adam_and_a_small_one_is_not() -> None:
    """An untied Llama with a 5,000-token vocabulary (wider than 4096 and than its hidden
    layers): the token table and the head keep Adam's direction (their dense ``V × V``
    factors would be 100 MB and an eigendecomposition of that side every refresh); the
    hidden matrices are preconditioned. With a small vocabulary, or ``skip_layers`` given,
    the rule leaves nothing out."""

    def llama(vocab: int) -> nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    vocabulary = {"model.embed_tokens", "lm_head"}
    model = llama(5000)
    opt = _train(model, steps=1, input_ids=_ids(), labels=_ids())
    assert not vocabulary & set(opt.preconditioner.layers)
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert all(rows[f"{name}.weight"]["method"] == "adam" for name in vocabulary)
    assert len(opt.preconditioner.layers) == 7  # q, k, v, o, gate, up, down
    assert vocabulary <= set(KFACOptimizer.for_model(llama(VOCAB)).preconditioner.layers)
    given = KFACOptimizer.for_model(llama(5000), skip_layers=["down_proj"])
    assert vocabulary <= set(given.preconditioner.layers)


def test_berts_two_pretraining_heads_are_heads_and_its_vocabulary_is_left_to_adam() -> None:
    """``BertForPreTraining`` (fx cannot trace it: roles by module order) has a masked-token
    decoder tied to the token table and a next-sentence head after it: the decoder was a
    hidden matrix (orthogonalised, its ``V × V`` factor built: 5,000² here, 30,522² for
    BERT's tokenizer, and it hid the token table from the vocabulary rule). It is a head
    now: with the token table it keeps Adam's direction; the next-sentence head is
    preconditioned, not orthogonalised."""
    config = transformers.BertConfig(
        vocab_size=5000, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH,
    )  # fmt: skip
    model = transformers.BertForPreTraining(config)
    ids = _ids()
    opt = _train(model, steps=1, input_ids=ids, labels=ids, next_sentence_label=ids[:, 0] % 2)
    roles = {r["name"]: r["role"] for r in opt.preconditioner.describe()}
    layers = set(opt.preconditioner.layers)
    assert "cls.predictions.decoder" not in layers
    assert "bert.embeddings.word_embeddings" not in layers
    assert roles["cls.seq_relationship"] == "head"
    assert roles["bert.pooler.dense"] == roles["cls.predictions.transform.dense"] == "hidden"
    assert "cls.seq_relationship" not in _orthogonal(opt)
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert rows["bert.embeddings.word_embeddings.weight"]["method"] == "adam"


def test_a_classifiers_loss_is_the_one_its_labels_choose_after_for_model() -> None:
    """``transformers``' classification loss picks its kind from the labels' dtype on its
    first call and stores it in ``config.problem_type``. ``for_model`` traces the forward on
    proxies to find the roles: the trace's guessed condition made it a multi-label loss, and
    the first real step failed on integer labels. The trace leaves the model's attributes
    (and its config's) as they were."""
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    model = transformers.ResNetForImageClassification(config)
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 1, 2, 1])
    opt = _train(model, pixel_values=pixels, labels=labels)
    assert model.config.problem_type == "single_label_classification"
    assert "resnet.embedder.embedder.convolution" in opt.preconditioner.layers


def test_a_layer_whose_weight_its_parent_applies_is_named_not_left_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MobileBERT's output layer is ``h @ cat([decoder.weight.T, dense.weight])``: neither
    ``decoder`` (tied to the token table) nor ``dense`` is ever called, so no factor is
    captured, so they get no update under the default (their plain gradient under the
    other methods), which no row of ``describe()`` and no warning said. A warning names each
    such layer once; ``skip_layers`` gives them Adam's direction."""
    config = transformers.MobileBertConfig(
        vocab_size=VOCAB, hidden_size=16, embedding_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, intra_bottleneck_size=8,
        true_hidden_size=8, num_feedforward_networks=1, max_position_embeddings=LENGTH,
    )  # fmt: skip
    model = transformers.MobileBertForMaskedLM(config)
    ids = _ids()
    with caplog.at_level("WARNING", logger="dkfac"):
        _train(model, steps=3, input_ids=ids, labels=ids)
    unrun = [r.getMessage() for r in caplog.records if "forward has never run" in r.getMessage()]
    skip = ["cls.predictions.decoder", "cls.predictions.dense"]
    assert sorted(m.split()[1] for m in unrun) == skip
    opt = KFACOptimizer.for_model(model, skip_layers=skip)
    rows = {r["name"]: r for r in opt.preconditioner.describe()}
    assert rows["cls.predictions.dense.weight"]["method"] == "adam"
