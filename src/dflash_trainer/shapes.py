"""The shapes of the benchmarks' random targets, as `AutoConfig.for_model` keyword arguments: plain data, importable
without torch or transformers (`benchmarks/hybrid_bench.py` chooses its kernels before transformers loads)."""

QWEN3_8B = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    tie_word_embeddings=False,
)

SMOLLM2_135M = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

_LINEAR, _FULL = "linear_attention", "full_attention"
# Qwen3.6-27B's text decoder (the same layout as Qwen3.5-27B; the target of the system this project replaces): 64
# layers, three Gated DeltaNet layers then one gated full-attention layer, repeated (48 + 16); hidden 5120, MLP 17408,
# vocab 248320; attention 24 heads, 4 KV heads, head dim 256, partial RoPE 0.25, theta 1e7; linear attention 16 key
# heads and 48 value heads of 128, convolution kernel 4. Source: the `text_config` of Qwen/Qwen3.6-27B's config.json,
# and the Qwen3.5-27B model cards giving the same numbers. Built in full (soft labels need the final norm and head).
QWEN36_27B = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    layer_types=[_LINEAR, _LINEAR, _LINEAR, _FULL] * 16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=False,
)
