//! Data parallel end to end on the CPU: LoRA runs on the tiny SD1.5 fixture on 2, 3 and 4
//! in-process ranks against the same run in one process.
#![cfg(test)]

use std::path::Path;
use std::time::Duration;

use candle_core::Device;

use super::data_parallel::train_ranks;
use super::test_runs::{lora, max_abs, repo};
use super::{train, RunOptions, TrainOutcome};
use crate::config::TrainPlan;

/// The runs here share the process-wide rank hook of [`super::oom::inject`]: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A LoRA run of `steps` steps of 1 × `accum` samples, logging every step with its gradient
/// norm.
fn plan(dir: &Path, accum: usize, steps: usize) -> TrainPlan {
    plan_batch(dir, 1, accum, steps)
}

fn plan_batch(dir: &Path, batch: usize, accum: usize, steps: usize) -> TrainPlan {
    plan_on(dir, batch, accum, steps, &repo().join("data/demo"))
}

fn plan_on(dir: &Path, batch: usize, accum: usize, steps: usize, data: &Path) -> TrainPlan {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("optimizer.json"), r#"{"log_grad_norm": true}"#).unwrap();
    let cfg = serde_json::json!({
        "model": repo().join("tests/fixtures/tiny-sd15"),
        "data_root": data,
        "output_dir": dir.join("out"),
        "optimizer_config": dir.join("optimizer.json"),
        "project_name": "dp",
        "mode": "lora",
        "adapter": {"save_dtype": "fp32"},
        "resolution": 64,
        "batch_size": batch,
        "grad_accum": accum,
        "max_steps": steps,
        "lr": 1e-3,
        "log_step": 1,
        "seed": 11,
    });
    let path = dir.join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap()
}

fn one_process(plan: &TrainPlan) -> TrainOutcome {
    let opts = RunOptions {
        device: Device::Cpu,
        show_progress: false,
    };
    train(plan, &opts).unwrap()
}

/// Each logged step's gradient norm.
fn grad_norms(out: &TrainOutcome) -> Vec<f64> {
    let log = std::fs::read_to_string(out.run_dir.join("train_log.jsonl")).unwrap();
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["grad_norm"].as_f64())
        .collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (x, y) in got.iter().zip(want) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1e-6),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn ranks_train_the_same_weights_as_one_process() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let (accum, steps) = (4, 3);
    let single = one_process(&plan(&tmp.path().join("one"), accum, steps));
    let norms = grad_norms(&single);
    assert_eq!(norms.len(), steps);
    // 3 ranks over 4 micro-batches: rank 0 takes two of them.
    for world in [2, 3, 4] {
        let dir = tmp.path().join(format!("ranks{world}"));
        let p = plan(&dir, accum, steps);
        let devices = vec![Device::Cpu; world];
        let out = train_ranks(&p, &devices, false, Duration::from_secs(120)).unwrap();
        let what = format!("{world} ranks");
        assert_eq!(out.images_seen, single.images_seen, "{what}");
        assert_eq!(out.images_seen, accum * steps, "{what}");
        // The summed loss and gradient: an average over the ranks instead of a sum, or a rank
        // left out of it, moves both.
        assert_close(&format!("{what}: losses"), &out.losses, &single.losses);
        assert_close(
            &format!("{what}: gradient norms"),
            &grad_norms(&out),
            &norms,
        );
        let (got, want) = (
            lora(out.saved.last().unwrap()),
            lora(single.saved.last().unwrap()),
        );
        assert_eq!(got.len(), want.len(), "{what}");
        // AdamW divides each gradient by its own running RMS, so a gradient's relative rounding
        // (sums over the samples that nearly cancel, taken in another order across ranks)
        // reaches the weights undamped: up to 1.2e-4 of a tensor's scale after three steps. The
        // bugs above move the losses and gradient norms by whole factors.
        for (name, w) in &want {
            let (scale, diff) = (max_abs(w), max_abs(&(&got[name] - w).unwrap()));
            assert!(
                diff <= 5e-4 * scale.max(1e-3),
                "{what}: {name} differs by {diff} (scale {scale})"
            );
        }
        // Rank 0 alone wrote a run folder.
        let runs = std::fs::read_dir(dir.join("out")).unwrap().count();
        assert_eq!(runs, 1, "{what}: run folders in the output dir");
    }
}

#[test]
fn options_that_cannot_run_data_parallel_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = plan(tmp.path(), 2, 1);
    p.precision.fused_backward_pass = true;
    let e = train_ranks(
        &p,
        &[Device::Cpu, Device::Cpu],
        false,
        Duration::from_secs(5),
    );
    assert!(format!("{:#}", e.unwrap_err()).contains("fused_backward_pass"));
}

/// An out-of-memory error on one rank: that rank halves its micro-batch and retries the same
/// samples, every rank goes on at the halved size, and the run trains what one process does.
#[test]
fn an_oom_on_one_rank_halves_every_rank_and_keeps_the_update() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let steps = 3;
    let single = one_process(&plan_batch(&tmp.path().join("one"), 2, 2, steps));
    let p = plan_batch(&tmp.path().join("ranks"), 2, 2, steps);
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = fired.clone();
    super::oom::inject::set_for_ranks(move |rank, step, ids| {
        let fire = rank == 1 && step == 1 && ids.len() > 1;
        if fire {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        fire
    });
    let out = train_ranks(
        &p,
        &[Device::Cpu, Device::Cpu],
        false,
        Duration::from_secs(120),
    );
    super::oom::inject::clear_ranks();
    let out = out.unwrap();
    assert_eq!(fired.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Rank 0 never ran out of memory, yet goes on at rank 1's halved size.
    assert_eq!(out.micro.size, 1, "{:?}", out.micro);
    assert_eq!(out.images_seen, single.images_seen);
    assert_close("losses", &out.losses, &single.losses);
    assert_close("gradient norms", &grad_norms(&out), &grad_norms(&single));
    let (got, want) = (
        lora(out.saved.last().unwrap()),
        lora(single.saved.last().unwrap()),
    );
    for (name, w) in &want {
        let (scale, diff) = (max_abs(w), max_abs(&(&got[name] - w).unwrap()));
        assert!(
            diff <= 1e-4 * scale.max(1e-3),
            "{name}: differs by {diff} (scale {scale})"
        );
    }
}

/// One rank's step for [`the_sum_is_the_same_in_chunks_of_any_size`]: gradients for the
/// parameters `have`, seeded by rank, a bf16 parameter among them.
fn rank_step(
    rank: usize,
    params: &[candle_core::Var],
    have: &[usize],
) -> super::accumulate::Accumulated {
    use candle_core::{backprop::GradStore, Tensor};
    let mut grads = GradStore::default();
    for &i in have {
        let v = &params[i];
        let n = v.elem_count();
        let vals: Vec<f32> = (0..n)
            .map(|k| ((k * 7 + i * 3 + rank * 11) % 13) as f32 - 6.0)
            .collect();
        let g = Tensor::from_vec(vals, v.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(v.dtype())
            .unwrap();
        grads.insert(v.as_tensor(), g);
    }
    super::accumulate::Accumulated {
        loss: Tensor::new(0.5f32 + rank as f32, &Device::Cpu).unwrap(),
        grads,
        micro_batches: 1 + rank,
        samples: 2 + rank,
    }
}

/// The step's sum over two ranks is each parameter's sum of the ranks' gradients (zeros where a
/// rank has none; none where no rank has one), the same whether the gradients go in one
/// exchange or in chunks of any size (one parameter per chunk, several, a chunk smaller than a
/// parameter). Catches an offset carried wrongly from chunk to chunk, a parameter skipped at a
/// chunk's edge, and a gradient that lost its dtype.
#[test]
fn the_sum_is_the_same_in_chunks_of_any_size() {
    use super::data_parallel::{reduce_step, RankLink};
    use crate::dist::InProcess;
    use candle_core::{DType, Var};
    let params: Vec<Var> = [
        (vec![3, 4], DType::F32),
        (vec![5], DType::BF16),
        (vec![2, 2], DType::F32),
        (vec![7], DType::F32),
        (vec![6], DType::F32),
    ]
    .into_iter()
    .map(|(d, dt)| Var::zeros(d, dt, &Device::Cpu).unwrap())
    .collect();
    let have: [&[usize]; 2] = [&[0, 1, 3], &[1, 2, 3]];
    let run = |chunk: usize| {
        let links = InProcess::group(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            let hs: Vec<_> = links
                .into_iter()
                .enumerate()
                .map(|(rank, link)| {
                    let params = &params;
                    s.spawn(move || {
                        let mut link = RankLink::host(Box::new(link));
                        let mut done = rank_step(rank, params, have[rank]);
                        reduce_step(&mut link, params, &mut done, chunk).unwrap();
                        done
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    let whole = run(usize::MAX);
    let one = rank_step(0, &params, have[0]);
    let two = rank_step(1, &params, have[1]);
    for (i, v) in params.iter().enumerate() {
        let got = whole[0].grads.get(v);
        if i == 4 {
            assert!(got.is_none(), "no rank has a gradient for parameter 4");
            continue;
        }
        let got = got.unwrap();
        assert_eq!(got.dtype(), v.dtype(), "parameter {i}'s dtype");
        let part = |d: &super::accumulate::Accumulated| {
            d.grads.get(v).map_or_else(
                || v.zeros_like().unwrap().to_dtype(DType::F32).unwrap(),
                |g| g.to_dtype(DType::F32).unwrap(),
            )
        };
        let want = (part(&one) + part(&two)).unwrap();
        let diff = (got.to_dtype(DType::F32).unwrap() - &want).unwrap();
        assert_eq!(max_abs(&diff), 0.0, "parameter {i}");
    }
    assert_eq!(whole[1].samples, 5);
    assert_eq!(whole[0].micro_batches, 3);
    assert_eq!(whole[1].loss.to_scalar::<f32>().unwrap(), 2.0);
    for chunk in [1, 5, 12, 17, 20] {
        let chunked = run(chunk);
        for (rank, (a, b)) in chunked.iter().zip(&whole).enumerate() {
            for (i, v) in params.iter().enumerate() {
                match (a.grads.get(v), b.grads.get(v)) {
                    (Some(x), Some(y)) => {
                        let diff = (x.to_dtype(DType::F32).unwrap()
                            - y.to_dtype(DType::F32).unwrap())
                        .unwrap();
                        assert_eq!(
                            max_abs(&diff),
                            0.0,
                            "chunk {chunk}, rank {rank}, parameter {i}"
                        )
                    }
                    (None, None) => {}
                    _ => panic!("chunk {chunk}, rank {rank}, parameter {i}: presence differs"),
                }
            }
        }
    }
}

/// A PNG whose container is whole (the dataset reads its size) but whose pixel data is
/// corrupt, so it fails only when the step decodes it.
fn corrupt_png(path: &Path) {
    let mut png = Vec::new();
    image::RgbImage::from_fn(64, 64, |x, y| image::Rgb([x as u8 * 4, y as u8 * 4, 9]))
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    let at = png.windows(4).position(|w| w == b"IDAT").unwrap();
    let len = u32::from_be_bytes([png[at - 4], png[at - 3], png[at - 2], png[at - 1]]) as usize;
    for b in &mut png[at + 4 + len / 4..at + 4 + len / 2] {
        *b ^= 0x5a;
    }
    std::fs::write(path, png).unwrap();
}

/// Each rank decodes only its own micro-batches, so a file that fails to decode is seen by the
/// rank that took it; the ranks agree on the failures and leave out the same samples, so the
/// losses and gradient norms are one process's and rank 0 counts every failure. A rank that left
/// out only its own failures would weigh its samples by another share of the step than the
/// others (the losses move), and rank 0 would count fewer.
#[test]
fn a_file_that_fails_to_decode_on_one_rank_is_left_out_on_every_rank() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    for entry in std::fs::read_dir(repo().join("data/demo")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, data.join(p.file_name().unwrap())).unwrap();
    }
    for name in ["broken_a", "broken_b", "broken_c"] {
        corrupt_png(&data.join(format!("{name}.png")));
    }
    let with_data = |dir: &Path| plan_on(dir, 1, 4, 3, &data);
    let single = one_process(&with_data(&tmp.path().join("one")));
    assert!(single.failed_samples > 0, "no image failed to decode");
    for world in [2, 3] {
        let p = with_data(&tmp.path().join(format!("ranks{world}")));
        let devices = vec![Device::Cpu; world];
        let out = train_ranks(&p, &devices, false, Duration::from_secs(120)).unwrap();
        let what = format!("{world} ranks");
        assert_eq!(out.failed_samples, single.failed_samples, "{what}");
        assert_eq!(out.images_seen, single.images_seen, "{what}");
        assert_close(&format!("{what}: losses"), &out.losses, &single.losses);
        assert_close(
            &format!("{what}: gradient norms"),
            &grad_norms(&out),
            &grad_norms(&single),
        );
    }
}
