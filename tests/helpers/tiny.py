"""The tiny Llama shape the callback tests share (its parameter count Ψ is hand-counted in test_metrics_flops.py)."""

TINY = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
