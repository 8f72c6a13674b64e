//! The training step's seams on the tiny fixtures, through the trainer's own functions:
//! - gradient accumulation: a batch of 4 cut into micro-batches (4×1, or 3+1) gives the
//!   gradients, loss and logged grad norm of the batch of 4 (same images, noise, timesteps);
//! - gradient checkpointing: gradients equal the plain path (≤ 1e-5 relative, f32) in full,
//!   LoRA and LoCon modes, with LoRA dropout on (its masks must replay in the recomputation).

mod common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use sdtrain::adapter::AdapterComponent;
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::data::{load_data_root, load_image, load_image_jittered};
use sdtrain::diffusion::{NoiseSchedule, Objective, ObjectiveConfig};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::model::source::ModelSource;
use sdtrain::nn::{BaseWeight, Checkpointing, LayerMut, VisitLayers};
use sdtrain::optim::StepCheck;
use sdtrain::train::accumulate::GradAccumulator;
use sdtrain::train::adapters::attach_with;
use sdtrain::train::step::{
    forward_backward, prepare_batch, sample_rngs, step_seeds, PreparedBatch, SampleData,
    StepSettings,
};

struct Model {
    sd: StableDiffusion,
    params: Vec<Var>,
    objective: Objective,
    train_te: bool,
}

fn adapter_plan(dropout: f64) -> AdapterPlan {
    AdapterPlan {
        rank: 4,
        alpha: 2.0,
        conv_rank: 2,
        conv_alpha: 1.0,
        train_text_encoder: true,
        train_unet: true,
        unet_lr: None,
        text_encoder_lr: None,
        dropout,
        factor: -1,
        init_from: None,
        save_dtype: SaveDtype::Fp32,
        training_metadata: true,
        training_comment: None,
        dim_from_weights: false,
        loraplus: Default::default(),
        rank_dropout: 0.0,
        module_dropout: 0.0,
        blocks: None,
        layer_filter: None,
        scale_weight_norms: None,
    }
}

/// The fixture `name` in `mode`, every trainable parameter listed; LoRA modes with `dropout`.
fn model(name: &str, mode: TrainMode, dropout: f64) -> Model {
    model_with(name, mode, dropout, Base::Stored)
}

/// How the frozen base is held.
#[derive(Clone, Copy, PartialEq)]
enum Base {
    /// As loaded (f32).
    Stored,
    /// In fp8 (`base_weight_dtype: "fp8"`).
    Fp8,
    /// As plain f32 tensors holding the values an fp8 base dequantises to.
    Fp8Values,
}

/// The UNet's and text encoders' layers, each visited with `f`.
fn each_layer(sd: &mut StableDiffusion, f: &mut dyn FnMut(LayerMut<'_>)) {
    sd.unet.visit_layers(f);
    for te in sd.text_encoders.iter_mut() {
        te.model.visit_layers(f);
    }
}

fn model_with(name: &str, mode: TrainMode, dropout: f64, base: Base) -> Model {
    let spec = common::fixture(name).display().to_string();
    let dir = ModelSource::parse(&spec).unwrap().resolve().unwrap();
    let layout = ModelLayout::read(&dir.path, None).unwrap();
    let full = mode == TrainMode::Full;
    let opts = LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: full,
        train_text_encoders: full,
        fp8_unet: base == Base::Fp8,
        fp8_text_encoders: base == Base::Fp8,
        trained_dtype: candle_core::DType::F32,
    };
    let mut sd = StableDiffusion::load(layout.clone(), &opts).unwrap();
    if base == Base::Fp8Values {
        each_layer(&mut sd, &mut |l| {
            let (w, s) = match l {
                LayerMut::Linear(l) => (&mut l.weight, &mut l.weight_scale),
                LayerMut::Conv2d(c) => (&mut c.weight, &mut c.weight_scale),
            };
            let b = BaseWeight::quantized(w, "w").unwrap();
            *w = b.get(DType::F32).unwrap();
            *s = None;
        });
    }
    let params: Vec<Var> = if full {
        let mut p: Vec<Var> = sd
            .unet_weights
            .params()
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        for te in &sd.text_encoders {
            p.extend(te.weights.params().into_iter().map(|(_, v)| v));
        }
        p
    } else {
        let a = attach_with(&mut sd, mode, adapter_plan(dropout), 17).unwrap();
        for m in &a.modules {
            m.set_training(true);
        }
        let mut p: Vec<Var> = a.params(false).into_iter().map(|(_, v)| v).collect();
        p.extend(a.params(true).into_iter().map(|(_, v)| v));
        assert!(a
            .modules
            .iter()
            .any(|m| m.component != AdapterComponent::Unet));
        p
    };
    let schedule = NoiseSchedule::from_file(&layout.scheduler_config).unwrap();
    let objective = Objective::new(schedule, ObjectiveConfig::plain(1000)).unwrap();
    Model {
        sd,
        params,
        objective,
        train_te: true,
    }
}

fn settings<'a>(m: &'a Model, ck: Option<&'a Checkpointing>) -> StepSettings<'a> {
    StepSettings {
        objective: &m.objective,
        flip_p: 0.5,
        cond_dropout: 0.0,
        shuffle_tags: false,
        keep_tags: 0,
        tag_dropout: 0.0,
        clip_skip_layers: 0,
        caption_chunks: 1,
        weighted_captions: false,
        caption_templates: &[],
        kohya_captions: None,
        clock: Default::default(),
        train_text_encoder: m.train_te,
        compute_dtype: DType::F32,
        checkpointing: ck,
        text_cache: None,
        unmasked_probability: None,
        prior_adapters: None,
    }
}

/// The demo images, decoded as 32 px squares.
fn data() -> Vec<SampleData> {
    let loaded = load_data_root(&common::repo_root().join("data/demo"), false).unwrap();
    loaded
        .items
        .iter()
        .map(|item| {
            let mut image = load_image(&item.path, 32).unwrap();
            image.caption = item.caption.clone();
            SampleData::Pixels(image)
        })
        .collect()
}

fn prepared(m: &Model, data: &[SampleData], n: usize) -> PreparedBatch {
    let images: Vec<_> = data.iter().take(n).collect();
    assert_eq!(images.len(), n, "the demo set has at least {n} images");
    let seeds: Vec<u64> = (0..n as u64).map(|i| 5 + i).collect();
    let mut rngs = sample_rngs(&seeds);
    prepare_batch(&m.sd, &images, &settings(m, None), &mut rngs).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `max|a − b| / max(max|b|, floor)`. The floor (1% of the largest gradient element of the
/// step) keeps gradients that are zero in exact arithmetic (a bias just before a norm, CLIP's
/// key bias), where both sides hold rounding noise near 1e-9, from failing on that noise.
fn rel(a: &Tensor, b: &Tensor, floor: f32) -> f32 {
    max_abs(&(a - b).unwrap()) / max_abs(b).max(floor).max(1e-30)
}

/// Every parameter with a gradient in `want` has one within `tol` in `got`, and vice versa.
fn assert_same_grads(got: &GradStore, want: &GradStore, params: &[Var], tol: f32, what: &str) {
    assert_same_grads_of(got, params, want, params, tol, what)
}

/// As [`assert_same_grads`] for two models' parameter lists, matched by position.
fn assert_same_grads_of(
    got: &GradStore,
    got_params: &[Var],
    want: &GradStore,
    want_params: &[Var],
    tol: f32,
    what: &str,
) {
    assert_eq!(got_params.len(), want_params.len());
    let largest = want_params
        .iter()
        .filter_map(|v| want.get(v))
        .map(max_abs)
        .fold(0f32, f32::max);
    let mut compared = 0;
    for (i, (gv, v)) in got_params.iter().zip(want_params).enumerate() {
        match (got.get(gv), want.get(v)) {
            (Some(g), Some(w)) => {
                let e = rel(g, w, 0.01 * largest);
                assert!(
                    e <= tol,
                    "{what}: parameter {i} {:?} differs by {e}",
                    v.dims()
                );
                compared += 1;
            }
            (None, None) => {}
            (g, w) => panic!(
                "{what}: parameter {i} has a gradient on one side only ({} vs {})",
                g.is_some(),
                w.is_some()
            ),
        }
    }
    assert!(compared > 0, "{what}: no gradients compared");
}

fn norm(grads: &GradStore, params: &[Var], loss: &Tensor) -> (f64, f32) {
    let present: Vec<&Tensor> = params.iter().filter_map(|v| grads.get(v)).collect();
    let c = StepCheck::fetch(loss, &present).unwrap();
    (c.loss, c.grad_norm)
}

/// Each sample draws from its own generator: a batch prepared whole equals the same samples
/// prepared in two halves, captions, timesteps, noised latents and targets (the OOM retry's
/// guarantee that retried samples get the same draws).
#[test]
fn a_batch_prepared_in_halves_draws_what_the_whole_batch_draws() {
    let data = data();
    let m = model("tiny-sd15", TrainMode::Lora, 0.0);
    let s = StepSettings {
        cond_dropout: 0.5,
        shuffle_tags: true,
        ..settings(&m, None)
    };
    let images: Vec<_> = data.iter().take(4).collect();
    let seeds = step_seeds(3, 5, 4);
    let whole = prepare_batch(&m.sd, &images, &s, &mut sample_rngs(&seeds)).unwrap();
    let halves: Vec<PreparedBatch> = [0..2, 2..4]
        .into_iter()
        .map(|r| {
            let mut rngs = sample_rngs(&seeds[r.clone()]);
            prepare_batch(&m.sd, &images[r], &s, &mut rngs).unwrap()
        })
        .collect();
    let captions: Vec<String> = halves.iter().flat_map(|h| h.captions.clone()).collect();
    assert_eq!(captions, whole.captions);
    let timesteps: Vec<u32> = halves
        .iter()
        .flat_map(|h| h.noised.timesteps.clone())
        .collect();
    assert_eq!(timesteps, whole.noised.timesteps);
    for (what, got, want) in [
        (
            "noisy",
            cat(&halves, |h| &h.noised.noisy),
            &whole.noised.noisy,
        ),
        (
            "target",
            cat(&halves, |h| &h.noised.target),
            &whole.noised.target,
        ),
    ] {
        let diff = max_abs(&(got - want).unwrap());
        assert!(diff <= 1e-6 * max_abs(want), "{what} differs by {diff}");
    }
    // Different seeds draw differently.
    let other = prepare_batch(&m.sd, &images, &s, &mut sample_rngs(&step_seeds(3, 6, 4))).unwrap();
    assert_ne!(other.noised.timesteps, whole.noised.timesteps);
}

fn cat(parts: &[PreparedBatch], f: impl Fn(&PreparedBatch) -> &Tensor) -> Tensor {
    Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap()
}

#[test]
fn accumulating_micro_batches_equals_one_batch() {
    let data = data();
    for mode in [TrainMode::Full, TrainMode::Lora] {
        let m = model("tiny-sd15", mode, 0.0);
        let s = settings(&m, None);
        let batch = prepared(&m, &data, 4);
        let (loss, whole) = forward_backward(&m.sd, &batch, &s, 1.0, 1.0).unwrap();
        let (want_loss, want_norm) = norm(&whole, &m.params, &loss);
        for size in [1, 3] {
            let mut acc = GradAccumulator::new(&m.params);
            for part in batch.split(size).unwrap() {
                let w = part.len() as f64 / batch.len() as f64;
                let (l, g) = forward_backward(&m.sd, &part, &s, w, 1.0).unwrap();
                acc.add(l, g, part.len()).unwrap();
            }
            let done = acc.finish(1.0).unwrap().unwrap();
            assert_eq!(done.samples, 4);
            let what = format!("{mode:?}, micro-batches of {size}");
            assert_same_grads(&done.grads, &whole, &m.params, 1e-5, &what);
            let (got_loss, got_norm) = norm(&done.grads, &m.params, &done.loss);
            assert!(
                (got_loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                "{what}: loss"
            );
            assert!(
                (got_norm - want_norm).abs() <= 1e-5 * want_norm,
                "{what}: grad norm {got_norm} vs {want_norm}"
            );
        }
    }
}

#[test]
fn a_loss_scale_is_divided_back_out() {
    let data = data();
    let m = model("tiny-sd15", TrainMode::Lora, 0.0);
    let s = settings(&m, None);
    let batch = prepared(&m, &data, 2);
    let (l, plain) = forward_backward(&m.sd, &batch, &s, 1.0, 1.0).unwrap();
    let (ls, scaled) = forward_backward(&m.sd, &batch, &s, 1.0, 1024.0).unwrap();
    assert_eq!(
        l.to_scalar::<f32>().unwrap(),
        ls.to_scalar::<f32>().unwrap()
    );
    let mut acc = GradAccumulator::new(&m.params);
    acc.add(ls, scaled, 2).unwrap();
    let done = acc.finish(1024.0).unwrap().unwrap();
    assert_same_grads(&done.grads, &plain, &m.params, 1e-6, "scale 1024");
}

fn checkpointed_matches_plain(name: &str, mode: TrainMode, dropout: f64) {
    let data = data();
    // Two models with the same seed: the same adapter init and the same dropout streams.
    let plain = model(name, mode, dropout);
    let mut ck_model = model(name, mode, dropout);
    let ck = Checkpointing::new(ck_model.params.clone(), &Device::Cpu).unwrap();
    ck_model.sd.unet.checkpointing = Some(ck.clone());
    for te in ck_model.sd.text_encoders.iter_mut() {
        te.model.checkpointing = Some(ck.clone());
    }
    let batch = prepared(&plain, &data, 2);
    let (l0, g0) = forward_backward(&plain.sd, &batch, &settings(&plain, None), 1.0, 1.0).unwrap();
    let s = settings(&ck_model, Some(&ck));
    let (l1, g1) = forward_backward(&ck_model.sd, &batch, &s, 1.0, 1.0).unwrap();
    let what = format!("{name} {mode:?} dropout {dropout}");
    assert_eq!(
        l0.to_scalar::<f32>().unwrap(),
        l1.to_scalar::<f32>().unwrap(),
        "{what}: loss"
    );
    assert_same_grads_of(&g1, &ck_model.params, &g0, &plain.params, 1e-5, &what);
}

#[test]
fn checkpointing_matches_the_plain_path_full() {
    checkpointed_matches_plain("tiny-sd15", TrainMode::Full, 0.0);
}

#[test]
fn checkpointing_matches_the_plain_path_lora_with_dropout() {
    checkpointed_matches_plain("tiny-sd15", TrainMode::Lora, 0.3);
}

#[test]
fn checkpointing_matches_the_plain_path_locon_sdxl() {
    checkpointed_matches_plain("tiny-sdxl", TrainMode::Locon, 0.1);
}

/// `gradient_checkpointing: "auto"` checkpoints some blocks: the loss and gradients still
/// equal the plain path's, and only the chosen blocks' resnets and transformer blocks run as
/// checkpointed segments. Catches a selection ignored (every block, or none, recomputed) or an
/// up block checkpointed under the wrong index.
#[test]
fn checkpointing_some_blocks_matches_the_plain_path() {
    use sdtrain::model::unet::{BlockRef, CheckpointedBlocks};
    let data = data();
    let plain = model("tiny-sd15", TrainMode::Full, 0.0);
    let mut ck_model = model("tiny-sd15", TrainMode::Full, 0.0);
    let ck = Checkpointing::new(ck_model.params.clone(), &Device::Cpu).unwrap();
    let unet = &mut ck_model.sd.unet;
    let mut blocks = CheckpointedBlocks::none(&unet.config);
    blocks.add(BlockRef::Down(0));
    let last_up = unet.up_blocks.len() - 1;
    blocks.add(BlockRef::Up(last_up));
    unet.checkpointed = blocks;
    unet.checkpointing = Some(ck.clone());
    let want_segments = {
        let d = &unet.down_blocks[0];
        let u = &unet.up_blocks[last_up];
        d.resnets.len() + d.attentions.len() + u.resnets.len() + u.attentions.len()
    };
    let batch = prepared(&plain, &data, 2);
    let (l0, g0) = forward_backward(&plain.sd, &batch, &settings(&plain, None), 1.0, 1.0).unwrap();
    let s = settings(&ck_model, Some(&ck));
    let (l1, g1) = forward_backward(&ck_model.sd, &batch, &s, 1.0, 1.0).unwrap();
    assert_eq!(ck.segments(), want_segments);
    assert_eq!(
        l0.to_scalar::<f32>().unwrap(),
        l1.to_scalar::<f32>().unwrap()
    );
    assert_same_grads_of(
        &g1,
        &ck_model.params,
        &g0,
        &plain.params,
        1e-5,
        "down 0, last up",
    );
}

/// `Tensor::backward_with` (the vendored candle's hook for a fused backward pass) hands every
/// trained parameter's gradient over exactly once, bit for bit the one `backward()` stores, and
/// keeps none of them. Catches a gradient handed over before its last contribution (a partial
/// sum) or handed over twice.
#[test]
fn backward_with_hands_over_each_final_gradient_once() {
    let data = data();
    let m = model("tiny-sd15", TrainMode::Full, 0.0);
    let s = settings(&m, None);
    let batch = prepared(&m, &data, 2);
    let loss = sdtrain::train::step::forward_loss(&m.sd, &batch, &s).unwrap();
    let want = loss.backward().unwrap();
    let mut seen: std::collections::HashMap<_, Tensor> = Default::default();
    let rest = loss
        .backward_with(&mut |node, g| {
            assert!(seen.insert(node.id(), g).is_none(), "handed over twice");
            Ok(())
        })
        .unwrap();
    let bits = |t: &Tensor| {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f32::to_bits).collect::<Vec<_>>()
    };
    for p in &m.params {
        let got = &seen[&p.as_tensor().id()];
        assert_eq!(bits(got), bits(want.get(p).unwrap()));
        assert!(rest.get(p).is_none());
    }
    assert_eq!(seen.len(), m.params.len());
}

/// SDXL's `time_ids` carry a bucketed image's real original size, its crop in the resized image
/// and the bucket as target; a flip mirrors the crop's left edge.
#[test]
fn time_ids_carry_the_original_size_and_crop() {
    use rand::SeedableRng;
    let m = model("tiny-sdxl", TrainMode::Lora, 0.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.png");
    image::RgbImage::from_fn(300, 100, |x, y| image::Rgb([x as u8, y as u8, 0]))
        .save(&path)
        .unwrap();
    // An off-centre jittered crop into the 96×40 bucket.
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let mut im = load_image_jittered(&path, (96, 40), 0.2, &mut rng, u64::MAX).unwrap();
    im.caption = "a wide image".into();
    let (top, left) = im.crop_top_left;
    let resized_w = im.resized_size.1;
    assert_ne!(
        left,
        resized_w - left - 96,
        "pick a crop that is not centred"
    );
    let sample = SampleData::Pixels(im);
    let mut s = settings(&m, None);
    for (flip_p, want_left) in [(0.0, left), (1.0, resized_w - left - 96)] {
        s.flip_p = flip_p;
        let b = prepare_batch(&m.sd, &[&sample], &s, &mut sample_rngs(&[1])).unwrap();
        let want = [100, 300, top, want_left, 40, 96].map(|v| v as f32);
        assert_eq!(b.time_ids[0], want, "flip_p {flip_p}");
    }
}

/// An fp8 base trains exactly as plain f32 weights holding the values it dequantises to: the same
/// loss and the same adapter gradients, bit for bit, with and without checkpointing. Catches a
/// layer whose backward uses anything but the dequantised weight (a missing scale, the codes
/// themselves) or an fp8 layer that skips its adapter.
fn fp8_base_equals_its_values(name: &str, mode: TrainMode, checkpoint: bool) {
    let data = data();
    let mut fp8 = model_with(name, mode, 0.2, Base::Fp8);
    let mut plain = model_with(name, mode, 0.2, Base::Fp8Values);
    let (mut stored, mut bytes) = (0, 0);
    each_layer(&mut fp8.sd, &mut |l| {
        let (w, s) = match l {
            LayerMut::Linear(l) => (&l.weight, &l.weight_scale),
            LayerMut::Conv2d(c) => (&c.weight, &c.weight_scale),
        };
        assert!(
            s.is_some() && w.dtype() == DType::U8,
            "a layer left unquantised"
        );
        stored += 1;
        bytes += w.elem_count();
    });
    assert!(
        stored > 50 && bytes > 100_000,
        "{stored} layers, {bytes} bytes"
    );
    let cks: Vec<Option<Checkpointing>> = [&mut fp8, &mut plain]
        .into_iter()
        .map(|m| {
            checkpoint.then(|| {
                let ck = Checkpointing::new(m.params.clone(), &Device::Cpu).unwrap();
                m.sd.unet.checkpointing = Some(ck.clone());
                for te in m.sd.text_encoders.iter_mut() {
                    te.model.checkpointing = Some(ck.clone());
                }
                ck
            })
        })
        .collect();
    let batch = prepared(&plain, &data, 2);
    let s0 = settings(&plain, cks[1].as_ref());
    let (l0, g0) = forward_backward(&plain.sd, &batch, &s0, 1.0, 1.0).unwrap();
    let s1 = settings(&fp8, cks[0].as_ref());
    let (l1, g1) = forward_backward(&fp8.sd, &batch, &s1, 1.0, 1.0).unwrap();
    let what = format!("{name} {mode:?} fp8 checkpointing {checkpoint}");
    assert_eq!(
        l0.to_scalar::<f32>().unwrap(),
        l1.to_scalar::<f32>().unwrap(),
        "{what}: loss"
    );
    assert_same_grads_of(&g1, &fp8.params, &g0, &plain.params, 0.0, &what);
}

#[test]
fn an_fp8_base_trains_as_its_dequantised_values_lora_sd15() {
    fp8_base_equals_its_values("tiny-sd15", TrainMode::Lora, false);
}

#[test]
fn an_fp8_base_trains_as_its_dequantised_values_locon_sdxl_checkpointed() {
    fp8_base_equals_its_values("tiny-sdxl", TrainMode::Locon, true);
}

/// kohya's `caption_tag_dropout_rate` in a prepared batch: at 1 only the main prompt and the
/// kept tags remain; at 0.5 a batch prepared in halves drops what the whole batch drops (one
/// draw per sample, from its own generator). A regularization image's `prior_loss_weight`
/// reaches the batch's sample weights, in order. Catches the dropout drawn from a shared
/// generator, a kept tag dropped, and the weights lost or misordered.
#[test]
fn tag_dropout_and_prior_weights_reach_the_prepared_batch() {
    let mut data = data();
    for (i, d) in data.iter_mut().enumerate() {
        let SampleData::Pixels(image) = d else {
            unreachable!("the demo images are decoded")
        };
        image.caption = format!("main {i}, keep, a, b, c, d");
        if i % 2 == 1 {
            let mut options = (*image.options).clone();
            options.prior_loss_weight = Some(0.25);
            image.options = std::sync::Arc::new(options);
        }
    }
    let m = model("tiny-sd15", TrainMode::Lora, 0.0);
    let images: Vec<_> = data.iter().take(4).collect();
    let seeds = step_seeds(3, 5, 4);
    let all = StepSettings {
        keep_tags: 1,
        tag_dropout: 1.0,
        ..settings(&m, None)
    };
    let batch = prepare_batch(&m.sd, &images, &all, &mut sample_rngs(&seeds)).unwrap();
    let want: Vec<String> = (0..4).map(|i| format!("main {i}, keep")).collect();
    assert_eq!(batch.captions, want);
    assert_eq!(batch.noised.sample_weights, [1.0, 0.25, 1.0, 0.25]);
    assert_eq!(
        batch.narrow(1, 2).unwrap().noised.sample_weights,
        [0.25, 1.0]
    );
    let half = StepSettings {
        tag_dropout: 0.5,
        ..all
    };
    let whole = prepare_batch(&m.sd, &images, &half, &mut sample_rngs(&seeds)).unwrap();
    let halves: Vec<String> = [0..2, 2..4]
        .into_iter()
        .flat_map(|r| {
            let mut rngs = sample_rngs(&seeds[r.clone()]);
            prepare_batch(&m.sd, &images[r], &half, &mut rngs)
                .unwrap()
                .captions
        })
        .collect();
    assert_eq!(halves, whole.captions);
    assert!(whole.captions.iter().all(|c| c.contains(", keep")));
    assert_ne!(whole.captions, batch.captions, "some tags survive at 0.5");
}

/// kohya's `keep_tokens_separator`, `secondary_separator`, `enable_wildcard`,
/// `caption_dropout_every_n_epochs` and token warmup in a prepared batch, against kohya's own
/// `process_caption` (tests/fixtures/kohya_caption_reference.py) on captions whose result draws
/// nothing at random; then, shuffled, the middle part alone moves
/// and a batch prepared in halves draws what the whole batch draws. Catches a separator left in,
/// the suffix or fixed part dropped or shuffled, and the secondary separator replaced before
/// the shuffle (its tags would come apart) or not at all.
#[test]
fn kohya_caption_keys_match_kohyas_process_caption() {
    use sdtrain::data::kohya_caption::{KohyaCaptions, TokenWarmup};
    use sdtrain::train::step::CaptionClock;
    let reference = common::reference_json("reference/kohya_captions.json");
    let m = model("tiny-sd15", TrainMode::Lora, 0.0);
    let mut data = data();
    let caption_of = |d: &mut SampleData, caption: &str| {
        let SampleData::Pixels(image) = d else {
            unreachable!("the demo images are decoded")
        };
        image.caption = caption.to_string();
    };
    let seeds = step_seeds(3, 5, 4);
    for case in reference["cases"].as_array().unwrap() {
        let text = |k: &str| case[k].as_str().map(str::to_string);
        let int = |k: &str, default: u64| case[k].as_u64().unwrap_or(default) as usize;
        let keys = KohyaCaptions {
            keep_tokens_separator: text("keep_tokens_separator"),
            secondary_separator: text("secondary_separator"),
            wildcard: case["wildcard"].as_bool().unwrap_or(false),
            random_line: false,
            dropout_every_n_epochs: int("every_n_epochs", 0),
            token_warmup: case["token_warmup_step"].as_f64().map(|steps| TokenWarmup {
                min: int("token_warmup_min", 1),
                steps,
            }),
        };
        let s = StepSettings {
            cond_dropout: 0.0,
            keep_tags: 0,
            tag_dropout: case["tag_dropout"].as_f64().unwrap_or(0.0),
            kohya_captions: Some(&keys),
            // kohya's epochs count from 1.
            clock: CaptionClock {
                epoch: Some(int("epoch", 1) - 1),
                step: int("step", 0),
                total_steps: int("max_train_steps", 100),
            },
            ..settings(&m, None)
        };
        let caption = text("caption").unwrap();
        caption_of(&mut data[0], &caption);
        let images = [&data[0]];
        let batch = prepare_batch(&m.sd, &images, &s, &mut sample_rngs(&seeds[..1])).unwrap();
        assert_eq!(batch.captions[0], text("expected").unwrap(), "{caption:?}");
    }

    let keys = KohyaCaptions {
        keep_tokens_separator: Some("|||".into()),
        secondary_separator: Some(";;;".into()),
        ..Default::default()
    };
    let s = StepSettings {
        cond_dropout: 0.0,
        shuffle_tags: true,
        kohya_captions: Some(&keys),
        ..settings(&m, None)
    };
    for d in data.iter_mut().take(4) {
        caption_of(d, "f1, f2 ||| a, b;;;c, d, e, g ||| s");
    }
    let images: Vec<_> = data.iter().take(4).collect();
    let whole = prepare_batch(&m.sd, &images, &s, &mut sample_rngs(&seeds)).unwrap();
    let halves: Vec<String> = [0..2, 2..4]
        .into_iter()
        .flat_map(|r| {
            let mut rngs = sample_rngs(&seeds[r.clone()]);
            prepare_batch(&m.sd, &images[r], &s, &mut rngs)
                .unwrap()
                .captions
        })
        .collect();
    assert_eq!(halves, whole.captions);
    for c in &whole.captions {
        assert!(c.starts_with("f1, f2, ") && c.ends_with(", s"), "{c}");
        let mut middle: Vec<&str> = c["f1, f2, ".len()..c.len() - ", s".len()]
            .split(", ")
            .collect();
        middle.sort();
        assert_eq!(middle, ["a", "b,c", "d", "e", "g"], "{c}");
    }
    let orders: std::collections::HashSet<&String> = whole.captions.iter().collect();
    assert!(
        orders.len() > 1,
        "the middle part is shuffled: {:?}",
        whole.captions
    );
}

/// A dataset config's subset captions as kohya's `process_caption` makes them with the subset's
/// own settings (tests/fixtures/kohya_dataset_config_reference.py): `keep_tokens` counting the
/// first piece and 0 keeping none, the subset's `caption_separator` (empty pieces kept, as
/// kohya keeps them), its prefix and suffix, and train.json's caption keys not applied. Catches
/// `keep_tokens` read as sdtrain's `keep_tags` (one more kept), the split on `,` whatever the
/// separator, the secondary separator replaced by `,`, and the step's settings used instead of
/// the subset's.
#[test]
fn dataset_config_subsets_caption_as_kohya() {
    use sdtrain::data::caption::with_affixes;
    use sdtrain::data::kohya_caption::{KohyaCaptions, SubsetCaptions, TokenWarmup};
    use sdtrain::data::ItemOptions;
    use sdtrain::train::step::CaptionClock;
    let reference = common::reference_json("reference/kohya_dataset_config.json");
    let m = model("tiny-sd15", TrainMode::Lora, 0.0);
    let mut data = data();
    let seeds = step_seeds(3, 5, 4);
    // train.json's own keys, which a subset's image must not see.
    let step_keys = KohyaCaptions {
        secondary_separator: Some("b".into()),
        ..Default::default()
    };
    for case in reference["captions"].as_array().unwrap() {
        let text = |k: &str| case[k].as_str().map(str::to_string);
        let int = |k: &str, default: u64| case[k].as_u64().unwrap_or(default) as usize;
        let rules = SubsetCaptions {
            shuffle: case["shuffle"].as_bool().unwrap_or(false),
            keep_tokens: int("keep_tokens", 0),
            separator: text("caption_separator").unwrap_or(",".into()),
            tag_dropout: case["tag_dropout"].as_f64().unwrap_or(0.0),
            tag_dropout_mode: Default::default(),
            keys: KohyaCaptions {
                keep_tokens_separator: text("keep_tokens_separator"),
                secondary_separator: text("secondary_separator"),
                token_warmup: case["token_warmup_step"].as_f64().map(|steps| TokenWarmup {
                    min: int("token_warmup_min", 1),
                    steps,
                }),
                ..Default::default()
            },
        };
        let s = StepSettings {
            cond_dropout: 0.0,
            shuffle_tags: true,
            keep_tags: 3,
            tag_dropout: 0.0,
            kohya_captions: Some(&step_keys),
            clock: CaptionClock {
                epoch: Some(0),
                step: int("step", 0),
                total_steps: 100,
            },
            ..settings(&m, None)
        };
        let SampleData::Pixels(image) = &mut data[0] else {
            unreachable!("the demo images are decoded")
        };
        // As a subset's scan writes it: the prefix and suffix on at load.
        let raw = text("caption").unwrap();
        image.caption = with_affixes(
            &raw,
            text("caption_prefix").as_deref(),
            text("caption_suffix").as_deref(),
        );
        image.options = std::sync::Arc::new(ItemOptions {
            cond_dropout: Some(0.0),
            subset_captions: Some(std::sync::Arc::new(rules)),
            ..ItemOptions::default()
        });
        let images = [&data[0]];
        let batch = prepare_batch(&m.sd, &images, &s, &mut sample_rngs(&seeds[..1])).unwrap();
        assert_eq!(
            batch.captions[0],
            text("expected").unwrap(),
            "{raw:?} {case}"
        );
    }
}
