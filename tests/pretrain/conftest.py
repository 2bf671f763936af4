"""Fixtures of the training-loop tests."""

import pytest
import torch

VOCAB = 4096  # pretrain.data.tokenizer.DEFAULT_VOCAB_SIZE: the built-in corpus's tokenizer
HF_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128, "initializer_range": 0.05}


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """(converted output directory, the transformers model): a tiny random Llama (GQA, untied) with
    the built-in tokenizer's vocabulary, saved as safetensors and run through convert_hf."""
    tf = pytest.importorskip("transformers")
    from pretrain.hf_convert import convert_hf_checkpoint, save_converted

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, **HF_SHAPE)).eval()
    hf_dir = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    out = tmp_path_factory.mktemp("converted")
    save_converted(convert_hf_checkpoint(str(hf_dir)), str(out))
    return out, model
