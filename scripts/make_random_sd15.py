#!/usr/bin/env python3
"""A full-size SD1.5 pipeline with random weights, for benchmarks and memory rehearsals.

Model weights cannot be downloaded here, so the real shapes come from the configs: the UNet of
runwayml/stable-diffusion-v1-5 (scripts/peer_bench_gpu.py's SD15_CONFIG, 859,520,964
parameters), its VAE (83,653,863) and CLIP ViT-L/14's text encoder (123,060,480), random
weights from a fixed seed, saved in float32 in the diffusers folder layout. The tokenizer is the
tiny fixture's (tests/fixtures/tiny-sd15/tokenizer: a real CLIP BPE with 2000 merges); its ids fit
the real 49408-token embedding. The scheduler is SD1.5's (PNDM, epsilon). The text encoder's keys
get the `text_model.` prefix real SD checkpoints have (transformers 5 saves them without it).

Usage (from the repository root; torch, diffusers and transformers needed):
    python3 scripts/make_random_sd15.py OUT_DIR
Writes OUT_DIR/{model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/} (about
4.3 GB) and prints the parameter counts. An existing OUT_DIR/model_index.json is left as it is.
"""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=512,
    scaling_factor=0.18215,
)
TEXT_CONFIG = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=1,
)
EXPECTED = {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


def add_text_model_prefix(path: Path):
    """transformers 5 saves CLIPTextModel without the `text_model.` key prefix that real SD
    checkpoints (and transformers 4) have; write the real layout."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    if all(k.startswith("text_model.") for k in sd):
        return
    save_file({f"text_model.{k}": v for k, v in sd.items()}, str(path), metadata={"format": "pt"})


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0])
    if (out / "model_index.json").exists():
        print(f"{out} exists; left as it is")
        return 0
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from peer_bench_gpu import SD15_CONFIG

    repo = Path(__file__).resolve().parent.parent
    torch.manual_seed(1505)
    unet = UNet2DConditionModel(**SD15_CONFIG)
    vae = AutoencoderKL(**VAE_CONFIG)
    text_encoder = CLIPTextModel(CLIPTextConfig(**TEXT_CONFIG))
    tokenizer = CLIPTokenizer.from_pretrained(repo / "tests/fixtures/tiny-sd15/tokenizer")
    scheduler = PNDMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
        num_train_timesteps=1000, set_alpha_to_one=False, steps_offset=1, skip_prk_steps=True,
        prediction_type="epsilon",
    )
    counts = {name: sum(p.numel() for p in m.parameters())
              for name, m in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder))}
    for name, n in counts.items():
        flag = "" if n == EXPECTED[name] else f"  (expected {EXPECTED[name]:,})"
        print(f"{name}: {n:,} parameters{flag}")
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    add_text_model_prefix(tmp / "text_encoder" / "model.safetensors")
    tmp.rename(out)
    print(f"wrote {out}")
    return 0 if counts == EXPECTED else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
