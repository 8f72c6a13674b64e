#!/usr/bin/env python3
"""The real SD1.5, SD2.1 and SDXL pipelines' components as config.json plus tensor shapes, for
`--dry-run` on full-size models without their weights (tests/presets_cli.rs).

Model weights cannot be downloaded here, so the shapes come from the real configs: each model
is built by diffusers / transformers on torch's meta device (no memory), and its state dict's
names, dtypes and shapes are written with its config. The Rust tests turn each file into a
diffusers folder whose safetensors files have the real headers and sparse, all-zero data
(tests/common/full_size.rs), beside the tiny fixture's scheduler and tokenizers.

Configs (non-default keys): runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1 and
stabilityai/stable-diffusion-xl-base-1.0 (unet, vae, text_encoder[_2]/config.json). Parameter
counts are printed and checked against the published ones.

Usage (from the repository root; tests/fixtures/requirements.txt):
    python3 scripts/make_full_size_shapes.py tests/fixtures/full-size
Writes OUT/{sd15,sd21,sdxl}.json.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SD21_UNET = dict(
    sample_size=96,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=1024,
    attention_head_dim=(5, 10, 20, 20),
    use_linear_projection=True,
    upcast_attention=True,
)
CLIP_L = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
    projection_dim=768, bos_token_id=49406, eos_token_id=49407, pad_token_id=1,
)
OPENCLIP_H = dict(
    vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
    num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu",
    projection_dim=512, bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
OPENCLIP_BIGG = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
    num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
    projection_dim=1280, bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
# Published parameter counts.
EXPECTED = {
    "sd15": {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480},
    "sd21": {"unet": 865_910_724, "vae": 83_653_863, "text_encoder": 340_387_840},
    "sdxl": {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
             "text_encoder_2": 694_659_840},
}


def vae_config(scaling_factor, sample_size):
    from make_random_sd15 import VAE_CONFIG

    return dict(VAE_CONFIG, scaling_factor=scaling_factor, sample_size=sample_size)


def component(model, file):
    """The model's config and its state dict's (name, dtype, shape), as saved (text encoders
    with the `text_model.` prefix real checkpoints have)."""
    import torch

    config = json.loads(model.config.to_json_string()) if hasattr(model.config, "to_json_string") \
        else dict(model.config)
    tensors = []
    for name, t in model.state_dict().items():
        if file == "model.safetensors" and not name.startswith(("text_model.", "text_projection")):
            name = f"text_model.{name}"
        assert t.dtype == torch.float32, (name, t.dtype)
        tensors.append([name, "F32", list(t.shape)])
    return {"config": config, "file": file, "tensors": tensors}, sum(
        t.numel() for t in model.state_dict().values()
    )


def family(name):
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from peer_bench_gpu import SD15_CONFIG, SDXL_CONFIG

    unet_cfg = {"sd15": SD15_CONFIG, "sd21": SD21_UNET, "sdxl": SDXL_CONFIG}[name]
    vae_cfg = vae_config(0.13025 if name == "sdxl" else 0.18215,
                         {"sd15": 512, "sd21": 768, "sdxl": 1024}[name])
    with torch.device("meta"):
        models = {
            "unet": (UNet2DConditionModel(**unet_cfg), "diffusion_pytorch_model.safetensors"),
            "vae": (AutoencoderKL(**vae_cfg), "diffusion_pytorch_model.safetensors"),
            "text_encoder": (CLIPTextModel(CLIPTextConfig(**(OPENCLIP_H if name == "sd21" else CLIP_L))),
                             "model.safetensors"),
        }
        if name == "sdxl":
            models["text_encoder_2"] = (
                CLIPTextModelWithProjection(CLIPTextConfig(**OPENCLIP_BIGG)), "model.safetensors")
    out, ok = {}, True
    for comp, (model, file) in models.items():
        out[comp], n = component(model, file)
        want = EXPECTED[name][comp]
        print(f"{name} {comp}: {n:,} parameters" + ("" if n == want else f" (expected {want:,})"))
        ok &= n == want
    return out, ok


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for name in ("sd15", "sd21", "sdxl"):
        shapes, good = family(name)
        ok &= good
        (out / f"{name}.json").write_text(json.dumps(shapes, separators=(",", ":"), sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
