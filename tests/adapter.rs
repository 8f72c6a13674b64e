//! LoRA/LoCon adapters on the tiny SD1.5 fixture and on the real configs:
//! - a fresh adapter (`up` = 0) leaves the outputs unchanged;
//! - `delta` is `(alpha/rank)·x·downᵀ·upᵀ` (Linear) and `(alpha/rank)·conv(conv(x, down), up)`
//!   (conv), as kohya's `LoRAModule.forward` computes it;
//! - after backward on a frozen base, the GradStore holds exactly the adapter Vars;
//! - module counts on the real SD1.5 / CLIP-L / SDXL configs match kohya's (SD1.5: 192 UNet,
//!   72 text-encoder modules).

mod common;

use common::max_abs_diff;

use sdtrain::model::reference_configs::{CLIP_BIGG, CLIP_L, SD15_UNET, SDXL_UNET};
use std::collections::HashSet;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use sdtrain::adapter::{
    adapter_vars, attach_text_encoder, attach_unet, AdapterComponent, AdapterMode, AdapterSpec,
    AttachError, LoraKind, LoraModule,
};
use sdtrain::model::clip::{ClipTextConfig, ClipTextModel};
use sdtrain::model::unet::{UNet2DConditionModel, UnetConfig};
use sdtrain::model::weights::Weights;
use sdtrain::nn::{LayerAdapter, LayerMut, VisitLayers};

fn spec(mode: AdapterMode) -> AdapterSpec {
    AdapterSpec {
        mode,
        rank: 4,
        alpha: 2.0,
        conv_rank: 2,
        conv_alpha: 1.0,
        dropout: 0.0,
        factor: -1,
        seed: 7,
    }
}

fn tiny_unet() -> UNet2DConditionModel {
    let dir = common::fixture("tiny-sd15").join("unet");
    let cfg = UnetConfig::from_file(&dir.join("config.json")).unwrap();
    let files = [dir.join("diffusion_pytorch_model.safetensors")];
    let w = Weights::from_files(&files, "unet", DType::F32, &Device::Cpu, false).unwrap();
    UNet2DConditionModel::new(&w, &cfg).unwrap()
}

fn tiny_text_encoder() -> ClipTextModel {
    let dir = common::fixture("tiny-sd15").join("text_encoder");
    let cfg = ClipTextConfig::from_file(dir.join("config.json")).unwrap();
    let files = [dir.join("model.safetensors")];
    let w = Weights::from_files(&files, "text_encoder", DType::F32, &Device::Cpu, false).unwrap();
    ClipTextModel::new(&w, &cfg, false).unwrap()
}

struct Inputs {
    sample: Tensor,
    timesteps: Tensor,
    ids: Tensor,
    ctx: Tensor,
}

fn inputs() -> Inputs {
    let refs = common::reference("tiny-sd15");
    let get = |k: &str| common::get(&refs, k);
    let sample = get("unet.sample");
    let b = sample.dim(0).unwrap();
    Inputs {
        sample,
        timesteps: get("unet.timesteps"),
        ids: get("te.input_ids").narrow(0, 0, b).unwrap(),
        ctx: get("unet.encoder_hidden_states"),
    }
}

fn set_random(v: &Var, seed: u64) {
    let n = v.elem_count();
    let vals: Vec<f32> = (0..n)
        .map(|i| ((((i as u64 + 1) * 2654435761 + seed * 7919) % 2001) as f32 / 1000.0) - 1.0)
        .collect();
    v.set(&Tensor::from_vec(vals, v.shape(), v.device()).unwrap())
        .unwrap();
}

#[test]
fn zero_initialised_adapters_do_not_change_outputs() {
    let inp = inputs();
    let mut unet = tiny_unet();
    let before = unet
        .forward(&inp.sample, &inp.timesteps, &inp.ctx, None)
        .unwrap();
    let mods = attach_unet(&mut unet, &spec(AdapterMode::Locon)).unwrap();
    assert!(mods.iter().all(|m| m
        .var("lora_up.weight")
        .unwrap()
        .as_tensor()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        == 0.0));
    let after = unet
        .forward(&inp.sample, &inp.timesteps, &inp.ctx, None)
        .unwrap();
    assert_eq!(max_abs_diff(&before, &after), 0.0);

    let mut te = tiny_text_encoder();
    let before = te.forward(&inp.ids, 0).unwrap().last_hidden_state;
    attach_text_encoder(
        &mut te,
        AdapterComponent::TextEncoder,
        &spec(AdapterMode::Lora),
    )
    .unwrap();
    let after = te.forward(&inp.ids, 0).unwrap().last_hidden_state;
    assert_eq!(max_abs_diff(&before, &after), 0.0);
}

#[test]
fn attaching_twice_is_an_error() {
    let mut unet = tiny_unet();
    attach_unet(&mut unet, &spec(AdapterMode::Lora)).unwrap();
    let e = attach_unet(&mut unet, &spec(AdapterMode::Lora)).unwrap_err();
    assert!(matches!(e, AttachError::AlreadyAttached { .. }), "{e}");
    assert!(e.to_string().contains("already has an adapter"), "{e}");
}

#[test]
fn attach_is_deterministic() {
    let (mut a, mut b) = (tiny_unet(), tiny_unet());
    let ma = attach_unet(&mut a, &spec(AdapterMode::Locon)).unwrap();
    let mb = attach_unet(&mut b, &spec(AdapterMode::Locon)).unwrap();
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x.module_path, y.module_path);
        assert_eq!(
            max_abs_diff(
                x.var("lora_down.weight").unwrap().as_tensor(),
                y.var("lora_down.weight").unwrap().as_tensor()
            ),
            0.0
        );
    }
}

fn find<'a>(mods: &'a [Arc<LoraModule>], suffix: &str) -> &'a Arc<LoraModule> {
    mods.iter()
        .find(|m| m.module_path.ends_with(suffix))
        .unwrap_or_else(|| panic!("no module ending in {suffix}"))
}

#[test]
fn delta_matches_hand_computation() {
    let mut unet = tiny_unet();
    let mods = attach_unet(&mut unet, &spec(AdapterMode::Locon)).unwrap();

    // Linear: (alpha/rank)·x·downᵀ·upᵀ.
    let q = find(&mods, "attn1.to_q");
    assert_eq!(q.kind, LoraKind::Linear);
    set_random(q.var("lora_up.weight").unwrap(), 1);
    let in_dim = q.var("lora_down.weight").unwrap().dim(1).unwrap();
    let x = common::randn(&[2, 5, in_dim], 11);
    let got = q.delta(&x).unwrap();
    let want = x
        .broadcast_matmul(&q.var("lora_down.weight").unwrap().as_tensor().t().unwrap())
        .unwrap()
        .broadcast_matmul(&q.var("lora_up.weight").unwrap().as_tensor().t().unwrap())
        .unwrap()
        .affine(2.0 / 4.0, 0.0)
        .unwrap();
    assert!(max_abs_diff(&got, &want) < 1e-5);

    // 3×3 conv (LoCon): conv with the base's geometry, then a 1×1 conv.
    let c = find(&mods, "resnets.0.conv1");
    let LoraKind::Conv {
        kernel,
        stride,
        padding,
    } = c.kind
    else {
        panic!("conv1 is a conv")
    };
    assert_eq!((kernel, c.rank, c.alpha), (3, 2, 1.0));
    set_random(c.var("lora_up.weight").unwrap(), 2);
    let ch = c.var("lora_down.weight").unwrap().dim(1).unwrap();
    let x = common::randn(&[1, ch, 6, 6], 12);
    let got = c.delta(&x).unwrap();
    let want = x
        .conv2d(
            c.var("lora_down.weight").unwrap().as_tensor(),
            padding,
            stride,
            1,
            1,
        )
        .unwrap()
        .conv2d(c.var("lora_up.weight").unwrap().as_tensor(), 0, 1, 1, 1)
        .unwrap()
        .affine(1.0 / 2.0, 0.0)
        .unwrap();
    assert!(max_abs_diff(&got, &want) < 1e-5);

    // The module changes the UNet output once `up` is non-zero, in the layer it is attached to.
    let inp = inputs();
    let out = unet
        .forward(&inp.sample, &inp.timesteps, &inp.ctx, None)
        .unwrap();
    let plain = tiny_unet()
        .forward(&inp.sample, &inp.timesteps, &inp.ctx, None)
        .unwrap();
    assert!(max_abs_diff(&out, &plain) > 1e-6);
}

#[test]
fn dropout_only_while_training() {
    let mut unet = tiny_unet();
    let mut s = spec(AdapterMode::Lora);
    s.dropout = 0.5;
    let mods = attach_unet(&mut unet, &s).unwrap();
    let q = find(&mods, "attn1.to_q");
    set_random(q.var("lora_up.weight").unwrap(), 3);
    let x = common::randn(
        &[1, 8, q.var("lora_down.weight").unwrap().dim(1).unwrap()],
        13,
    );
    let eval = q.delta(&x).unwrap();
    assert_eq!(max_abs_diff(&eval, &q.delta(&x).unwrap()), 0.0);
    q.set_training(true);
    let train = q.delta(&x).unwrap();
    assert!(max_abs_diff(&eval, &train) > 1e-6);
    q.set_training(false);
}

/// After backward with a frozen base: every adapter Var has a finite gradient (`up` non-zero),
/// and no Linear/Conv weight or bias has an entry, nor does any weight-sized gradient exist
/// (the frozen ops skip candle's weight-gradient GEMMs). With `strict`, every entry must be an
/// adapter Var: that also needs the norms' frozen γ/β, the resnets' time-embedding add and the
/// attention mask add to go through `nn::frozen_broadcast_{mul,add}` (candle stores an
/// activation-sized gradient for an untracked operand of a binary op).
fn check_grad_store(mode: AdapterMode, strict: bool) {
    let inp = inputs();
    let mut unet = tiny_unet();
    let mut te = tiny_text_encoder();
    let mut mods = attach_unet(&mut unet, &spec(mode)).unwrap();
    mods.extend(attach_text_encoder(&mut te, AdapterComponent::TextEncoder, &spec(mode)).unwrap());
    let mut base: Vec<Tensor> = Vec::new();
    let mut collect = |l: LayerMut<'_>| match l {
        LayerMut::Linear(l) => base.extend(
            [Some(l.weight.clone()), l.bias.clone()]
                .into_iter()
                .flatten(),
        ),
        LayerMut::Conv2d(c) => base.extend(
            [Some(c.weight.clone()), c.bias.clone()]
                .into_iter()
                .flatten(),
        ),
    };
    unet.visit_layers(&mut collect);
    te.visit_layers(&mut collect);
    let vars = adapter_vars(&mods);
    let ctx = te.forward(&inp.ids, 0).unwrap().last_hidden_state;
    let out = unet
        .forward(&inp.sample, &inp.timesteps, &ctx, None)
        .unwrap();
    let target = Tensor::zeros_like(&out).unwrap();
    // The training loss (its target is a constant and gets no gradient).
    let loss = sdtrain::diffusion::objective::mse_loss(&out, &target, None).unwrap();
    let grads = loss.backward().unwrap();

    for p in &base {
        assert!(
            p.is_variable() || !p.track_op(),
            "base parameter is trainable"
        );
        assert!(
            grads.get(p).is_none(),
            "a base weight/bias got a gradient {:?}",
            p.dims()
        );
    }
    let weight_shapes: HashSet<Vec<usize>> = base
        .iter()
        .filter(|p| p.rank() >= 2)
        .map(|p| p.dims().to_vec())
        .collect();
    let adapter_ids: HashSet<_> = vars.iter().map(|v| v.as_tensor().id()).collect();
    let stray: Vec<Vec<usize>> = grads
        .get_ids()
        .filter(|id| !adapter_ids.contains(id))
        .filter_map(|id| grads.get_id(*id).map(|g| g.dims().to_vec()))
        .collect();
    let stray_elems: usize = stray.iter().map(|d| d.iter().product::<usize>()).sum();
    println!(
        "{mode:?}: {} adapter Vars, {} other GradStore entries ({stray_elems} elements)",
        vars.len(),
        stray.len()
    );
    for d in &stray {
        assert!(
            !weight_shapes.contains(d),
            "a weight-shaped gradient {d:?} was stored"
        );
    }
    if strict {
        assert!(
            stray.is_empty(),
            "{} non-adapter gradients: {stray:?}",
            stray.len()
        );
    }
    for m in &mods {
        for (name, v) in [
            ("down", m.var("lora_down.weight").unwrap()),
            ("up", m.var("lora_up.weight").unwrap()),
        ] {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{} {name}: no gradient", m.module_path));
            let a = g
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                a.is_finite(),
                "{} {name}: non-finite gradient",
                m.module_path
            );
            if name == "up" {
                assert!(a > 0.0, "{} up: zero gradient", m.module_path);
            }
        }
    }
}

#[test]
fn grad_store_has_adapter_grads_and_no_base_weight_grads_lora() {
    check_grad_store(AdapterMode::Lora, false);
}

#[test]
fn grad_store_has_adapter_grads_and_no_base_weight_grads_locon() {
    check_grad_store(AdapterMode::Locon, false);
}

#[test]
fn grad_store_holds_exactly_the_adapter_vars() {
    check_grad_store(AdapterMode::Lora, true);
    check_grad_store(AdapterMode::Locon, true);
}

/// Random f16 weights (half the memory of f32; attaching reads only shapes).
fn real_unet(json: &str) -> UNet2DConditionModel {
    let cfg = UnetConfig::from_json(json, "real unet config").unwrap();
    let w = Weights::random(0, "unet", DType::F16, &Device::Cpu, false);
    UNet2DConditionModel::new(&w, &cfg).unwrap()
}

fn real_te(json: &str, projection: bool) -> ClipTextModel {
    let cfg = ClipTextConfig::from_json(json, std::path::Path::new("te config")).unwrap();
    let w = Weights::random(0, "text_encoder", DType::F16, &Device::Cpu, false);
    ClipTextModel::new(&w, &cfg, projection).unwrap()
}

/// (lora, locon) UNet module counts, on one model: the lora adapters are detached in between.
fn counts(unet_json: &str) -> (usize, usize) {
    let mut unet = real_unet(unet_json);
    let lora = attach_unet(&mut unet, &spec(AdapterMode::Lora))
        .unwrap()
        .len();
    unet.visit_layers(&mut |l| match l {
        LayerMut::Linear(l) => l.adapter = None,
        LayerMut::Conv2d(c) => c.adapter = None,
    });
    let locon = attach_unet(&mut unet, &spec(AdapterMode::Locon))
        .unwrap()
        .len();
    (lora, locon)
}

/// kohya: SD1.5 "lora" has 192 UNet and 72 text-encoder modules; LoCon adds 22 resnets × 3
/// (conv1, conv2, time_emb_proj) + 14 conv_shortcuts + 3 downsamplers + 3 upsamplers = 86.
#[test]
fn module_counts_on_the_real_sd15_configs() {
    let (lora, locon) = counts(SD15_UNET);
    let mut te = real_te(CLIP_L, false);
    let te_n = attach_text_encoder(
        &mut te,
        AdapterComponent::TextEncoder,
        &spec(AdapterMode::Lora),
    )
    .unwrap()
    .len();
    println!("SD1.5: UNet lora {lora}, UNet locon {locon}, TE {te_n}");
    assert_eq!((lora, locon, te_n), (192, 278, 72));
}

/// kohya: SDXL "lora" has 722 UNet modules, 72 on text_encoder and 192 on text_encoder_2;
/// LoCon adds 17 resnets × 3 + 11 conv_shortcuts + 2 downsamplers + 2 upsamplers = 66.
/// About 5 GB of f16 random weights: run with `--ignored`.
#[test]
#[ignore = "builds the 2.6B-parameter SDXL UNet (5 GB) and bigG"]
fn module_counts_on_the_real_sdxl_configs() {
    let (lora, locon) = counts(SDXL_UNET);
    let mut te1 = real_te(CLIP_L, false);
    let te1_n = attach_text_encoder(
        &mut te1,
        AdapterComponent::TextEncoder,
        &spec(AdapterMode::Lora),
    )
    .unwrap()
    .len();
    let mut te2 = real_te(CLIP_BIGG, true);
    let te2_n = attach_text_encoder(
        &mut te2,
        AdapterComponent::TextEncoder2,
        &spec(AdapterMode::Lora),
    )
    .unwrap()
    .len();
    println!("SDXL: UNet lora {lora}, UNet locon {locon}, TE1 {te1_n}, TE2 {te2_n}");
    assert_eq!((lora, locon, te1_n, te2_n), (722, 788, 72, 192));
}
