//! Data parallel from the command line on the CPU: `--devices cpu,cpu` (ranks as threads), two
//! processes joined through torchrun's environment on 127.0.0.1, a process killed mid-run, and
//! `--dry-run` with devices.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

fn config(dir: &Path, steps: usize) -> std::path::PathBuf {
    config_with(dir, steps, serde_json::json!({}))
}

/// [`config`] with `extra` keys on top.
fn config_with(dir: &Path, steps: usize, extra: serde_json::Value) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut keys = serde_json::json!({
        "mode": "lora",
        "grad_accum": 2,
        "max_steps": steps,
        "seed": 3,
        "adapter": {"save_dtype": "fp32"},
    });
    if let (Some(k), Some(e)) = (keys.as_object_mut(), extra.as_object()) {
        k.extend(e.clone());
    }
    write_config(dir, "tiny-sd15", &demo_data(), keys)
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank `rank` of a two-process run on this machine's CPU.
fn rank_process(cfg: &Path, port: u16, rank: usize, cwd: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args([
            "--config",
            cfg.to_str().unwrap(),
            "--cpu",
            "--dist-timeout",
            "60",
        ])
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("WORLD_SIZE", "2")
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .current_dir(cwd)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn threads_and_processes_train_what_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    let out = sdtrain(
        &["--config", config(&one, 3).to_str().unwrap(), "--cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let want = step_losses(&run_folder(&one));
    assert_eq!(want.len(), 3);

    let threads = tmp.path().join("threads");
    let cfg = config(&threads, 3);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--devices", "cpu,cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    // Rank 0 speaks for the run: the thread ranks' setup lines are not repeated.
    for line in ["data: 8 images loaded", "model: ", "aspect buckets: "] {
        assert_eq!(
            text(&out).matches(line).count(),
            1,
            "{line}: {}",
            text(&out)
        );
    }
    assert_close(
        "--devices cpu,cpu",
        &step_losses(&run_folder(&threads)),
        &want,
    );

    let procs = tmp.path().join("procs");
    let cfg = config(&procs, 3);
    let port = free_port();
    let ranks: Vec<Child> = (0..2)
        .map(|r| rank_process(&cfg, port, r, tmp.path()))
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "rank {r}: {}", text(&o));
        // Rank 0 alone prints the summary and the setup lines; rank 1 says it joined.
        for (line, on_rank_0) in [
            ("images seen", true),
            ("data: 8 images loaded", true),
            ("model: ", true),
            ("rank 1 of 2: joined the run at 127.0.0.1:", false),
        ] {
            assert_eq!(
                text(&o).contains(line),
                (r == 0) == on_rank_0,
                "rank {r}, {line}: {}",
                text(&o)
            );
        }
    }
    // One run folder (rank 0's), with the losses of one process.
    assert_close("two processes", &step_losses(&run_folder(&procs)), &want);
}

/// A kohya dataset config of two datasets at their own resolution and batch size: a step's two
/// micro-batches can hold 2 images at 64 px and 1 at 128 px, one on each rank. Two thread ranks
/// train what one process does. Catches a rank's micro-batch weighed by its count of
/// micro-batches instead of its images, and a rank that buckets by the first dataset's size.
#[test]
fn ranks_train_datasets_of_two_resolutions_as_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let toml = tmp.path().join("datasets.toml");
    common::cli::two_resolution_datasets(&toml, &demo_data());
    let extra = serde_json::json!({"dataset_config": toml});
    let one = tmp.path().join("one");
    let cfg = config_with(&one, 3, extra.clone());
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let want = step_losses(&run_folder(&one));
    assert_eq!(want.len(), 3);
    let threads = tmp.path().join("threads");
    let cfg = config_with(&threads, 3, extra);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--devices", "cpu,cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_close(
        "--devices cpu,cpu",
        &step_losses(&run_folder(&threads)),
        &want,
    );
}

/// Both ranks of a two-process run, each with its own config: their outputs, rank order.
fn two_processes(cfgs: [&Path; 2], cwd: &Path) -> Vec<std::process::Output> {
    let port = free_port();
    let ranks: Vec<Child> = (0..2)
        .map(|r| rank_process(cfgs[r], port, r, cwd))
        .collect();
    ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// `seed: -1` draws a seed in each process: the ranks take rank 0's, so the run is the one
/// process run with that seed. Catches each rank keeping its own draw (the ranks then train
/// other images in each micro-batch and other noise, and the losses move).
#[test]
fn processes_with_a_drawn_seed_train_rank_0s_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let procs = tmp.path().join("procs");
    let cfg = config_with(&procs, 3, serde_json::json!({"seed": -1}));
    for (r, o) in two_processes([&cfg, &cfg], tmp.path()).iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(o));
    }
    let run = run_folder(&procs);
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("plan.json")).unwrap()).unwrap();
    let seed = plan["seed"].as_u64().unwrap();
    let one = tmp.path().join("one");
    let cfg = config_with(&one, 3, serde_json::json!({ "seed": seed }));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    assert_close(
        "two processes, seed -1",
        &step_losses(&run),
        &step_losses(&run_folder(&one)),
    );
}

/// Two processes whose train.json differ (another learning rate), or whose data differ (one
/// caption changed in rank 1's copy of data_root), stop before training, each naming what
/// differs. Paths may differ: rank 1's data_root is another folder in the second case.
#[test]
fn processes_with_other_settings_or_data_stop_naming_the_difference() {
    let tmp = tempfile::tempdir().unwrap();
    let a = config_with(&tmp.path().join("a"), 2, serde_json::json!({}));
    let b = config_with(&tmp.path().join("b"), 2, serde_json::json!({"lr": 2e-3}));
    let out = two_processes([&a, &b], tmp.path());
    let (rank0, rank1) = (text(&out[0]), text(&out[1]));
    assert!(!out[0].status.success() && !out[1].status.success());
    assert!(
        rank0.contains("rank 1's train.json differs from rank 0's")
            && rank0.contains("lr is 0.002 here, 0.001 on rank 0"),
        "{rank0}"
    );
    assert!(
        rank1.contains("this rank's train.json differs from rank 0's"),
        "{rank1}"
    );

    let data = tmp.path().join("data-copy");
    std::fs::create_dir_all(&data).unwrap();
    for e in std::fs::read_dir(demo_data()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, data.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(data.join("blue_stripes.txt"), "a changed caption").unwrap();
    let c = tmp.path().join("c");
    std::fs::create_dir_all(&c).unwrap();
    let c = write_config(
        &c,
        "tiny-sd15",
        &data,
        serde_json::json!({"mode": "lora", "grad_accum": 2, "max_steps": 2, "seed": 3,
            "adapter": {"save_dtype": "fp32"}}),
    );
    let out = two_processes([&a, &c], tmp.path());
    let (rank0, rank1) = (text(&out[0]), text(&out[1]));
    assert!(!out[0].status.success() && !out[1].status.success());
    assert!(
        rank1.contains("this rank's training images differ from rank 0's")
            && rank1.contains("blue_stripes.png"),
        "{rank1}"
    );
    assert!(
        rank0.contains("rank 1's training images differ") && rank0.contains("blue_stripes.png"),
        "{rank0}"
    );
}

/// Copies `from` into `to`, folders included.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &dest);
        } else {
            std::fs::copy(&p, dest).unwrap();
        }
    }
}

/// A rank whose machine holds another model (here the same pipeline with every UNet weight one
/// ulp away, as another revision would be) stops before training, naming the file; so does
/// rank 0. Catches ranks that train from different models without noticing (their gradients
/// are summed all the same, and the adapters stay identical).
#[test]
fn processes_that_load_other_model_files_stop_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model-copy");
    copy_tree(&common::fixture("tiny-sd15"), &model);
    let unet = model.join("unet/diffusion_pytorch_model.safetensors");
    let mut bytes = std::fs::read(&unet).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for b in bytes[header..].iter_mut().step_by(4) {
        *b ^= 1; // the lowest mantissa bit of every f32
    }
    std::fs::write(&unet, bytes).unwrap();
    let a = config_with(&tmp.path().join("a"), 2, serde_json::json!({}));
    let b = config_with(
        &tmp.path().join("b"),
        2,
        serde_json::json!({ "model": model }),
    );
    let out = two_processes([&a, &b], tmp.path());
    let (rank0, rank1) = (text(&out[0]), text(&out[1]));
    assert!(!out[0].status.success() && !out[1].status.success());
    assert!(
        rank1.contains("this rank starts from other files than rank 0: its unet weights")
            && rank1.contains("model-copy"),
        "{rank1}"
    );
    assert!(
        rank0.contains("rank 1 starts from other model or adapter files"),
        "{rank0}"
    );
}

/// Two processes resume a run, rank 1 from a copy of its folder that lacks the newest save
/// point (copied before it was written): rank 1 would start from step 1 while rank 0 starts from
/// step 2. Both stop before training, rank 1 naming its save point; from the same folder they
/// resume.
#[test]
fn processes_resuming_from_other_save_points_stop_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let first = tmp.path().join("first");
    let cfg = config_with(&first, 2, serde_json::json!({"save_every_n_steps": 1}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(&first);
    let copy = tmp.path().join("run-copy");
    copy_tree(&run, &copy);
    std::fs::remove_dir_all(copy.join("state-step-000002")).unwrap();
    let resume = |name: &str, from: &Path| {
        config_with(
            &tmp.path().join(name),
            4,
            serde_json::json!({"save_every_n_steps": 1, "resume_ckpt": from}),
        )
    };
    let (a, b) = (resume("a", &run), resume("b", &copy));
    let out = two_processes([&a, &b], tmp.path());
    let (rank0, rank1) = (text(&out[0]), text(&out[1]));
    assert!(!out[0].status.success() && !out[1].status.success());
    assert!(
        rank1.contains("its save point state-step-000001"),
        "{rank1}"
    );
    assert!(rank0.contains("rank 1 starts from other"), "{rank0}");

    let c = resume("c", &run);
    let out = two_processes([&a, &c], tmp.path());
    for (r, o) in out.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(o));
    }
}

/// Rank 0 alone samples: in a two-process run rank 0 writes the round and announces it, and
/// rank 1 neither sets the prompts up nor says it samples (its scratch folder is no place for
/// them).
#[test]
fn only_rank_0_samples_in_a_two_process_run() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.json");
    std::fs::write(
        &prompts,
        r#"{"cfgs": [5], "num_inference_steps": 2, "samples": [{"prompt": "a dog"}]}"#,
    )
    .unwrap();
    let dir = tmp.path().join("run");
    let cfg = config_with(
        &dir,
        2,
        serde_json::json!({"sample_prompts": prompts, "sample_steps": 2}),
    );
    let out = two_processes([&cfg, &cfg], tmp.path());
    for (r, o) in out.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(o));
        assert_eq!(
            text(o).contains("samples: 1 prompt every 2 steps"),
            r == 0,
            "rank {r}: {}",
            text(o)
        );
    }
    let samples = run_folder(&dir).join("samples");
    assert!(
        samples.join("gs00002-grid.png").is_file(),
        "{}",
        text(&out[0])
    );
}

/// What several ranks cannot honour is refused in processes too, not only with `--devices`.
/// Catches a multi-process run that trains with `fused_backward_pass` (each rank updating its
/// weights before the sum, so the ranks' weights part).
#[test]
fn processes_refuse_what_several_ranks_cannot_honour() {
    let tmp = tempfile::tempdir().unwrap();
    for key in ["fused_backward_pass", "load_settings_every_epoch"] {
        let cfg = config_with(&tmp.path().join(key), 2, serde_json::json!({ key: true }));
        for (r, o) in two_processes([&cfg, &cfg], tmp.path()).iter().enumerate() {
            assert!(!o.status.success(), "rank {r} trained with {key}");
            assert!(
                text(o).contains(key) && text(o).contains("several devices"),
                "rank {r}: {}",
                text(o)
            );
        }
    }
}

#[test]
fn a_killed_rank_ends_the_run_on_the_other_with_its_number() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(&tmp.path().join("run"), 200);
    let port = free_port();
    let rank0 = rank_process(&cfg, port, 0, tmp.path());
    let mut rank1 = rank_process(&cfg, port, 1, tmp.path());
    std::thread::sleep(Duration::from_secs(8));
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let start = Instant::now();
    let o = rank0.wait_with_output().unwrap();
    assert!(!o.status.success(), "rank 0 finished: {}", text(&o));
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "{:?}",
        start.elapsed()
    );
    let msg = text(&o);
    // Killed after joining: "rank 1 left the run"; before: "rank(s) [1] did not arrive".
    assert!(msg.contains("rank 1") || msg.contains("[1]"), "{msg}");
}

#[test]
fn dry_run_prints_the_per_card_plan_and_bad_lists_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), 1);
    let cfg = cfg.to_str().unwrap();
    let out = sdtrain(
        &["--config", cfg, "--devices", "cpu,cpu", "--dry-run"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("2 ranks (cpu, cpu)"), "{}", text(&out));
    let out = sdtrain(&["--config", cfg, "--devices", "0,0"], tmp.path());
    assert!(!out.status.success());
    assert!(text(&out).contains("card 0 twice"), "{}", text(&out));
}

#[test]
fn a_two_rank_save_point_resumes_on_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = |dir: &Path| config_with(dir, 4, serde_json::json!({"save_every_n_steps": 2}));
    let one = tmp.path().join("one");
    let out = sdtrain(
        &["--config", extra(&one).to_str().unwrap(), "--cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let want = step_losses(&run_folder(&one));

    let two = tmp.path().join("two");
    let cfg = extra(&two);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--devices", "cpu,cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(&two);
    let point = run.join("state-step-000002");
    assert!(
        point.is_dir(),
        "no save point at step 2 in {}",
        run.display()
    );
    let resume = format!("resume_ckpt={}", point.display());
    let cfg = cfg.to_str().unwrap();
    let out = sdtrain(&["--config", cfg, "--cpu", "--set", &resume], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from"), "{}", text(&out));
    // A resumed log drops the steps after its save point: the two-rank run's steps 1 and 2,
    // then the resumed run's 3 and 4.
    assert_close("two ranks, then one process", &step_losses(&run), &want);
}

/// One process and two ranks (threads) with the latent cache `key` on: the one process encodes
/// all 8 images, each rank half of them, and the ranks train what the one process does.
/// `where_` is the cache's place in the summary's line. Returns the two-rank run's folder.
fn two_ranks_split_the_cache(tmp: &Path, key: &str, where_: &str) -> std::path::PathBuf {
    let cfg = |dir: &Path| config_with(dir, 2, serde_json::json!({ key: true }));
    let one = tmp.join("one");
    let out = sdtrain(&["--config", cfg(&one).to_str().unwrap(), "--cpu"], tmp);
    assert!(out.status.success(), "{}", text(&out));
    let line = format!("{where_}: 8 encoded, 0 reused");
    assert!(text(&out).contains(&line), "{}", text(&out));
    let want = step_losses(&run_folder(&one));

    let two = tmp.join("two");
    let config = cfg(&two);
    let out = sdtrain(
        &["--config", config.to_str().unwrap(), "--devices", "cpu,cpu"],
        tmp,
    );
    assert!(out.status.success(), "{}", text(&out));
    let line = format!("{where_}: 4 encoded, 4 by the other ranks, 0 reused");
    assert!(text(&out).contains(&line), "{}", text(&out));
    assert_close(key, &step_losses(&run_folder(&two)), &want);
    two
}

/// With a disk latent cache, the two ranks (one folder) each encode half of the 8 images
/// (`cache_share`), and train what one process with the same cache does.
#[test]
fn two_ranks_split_the_disk_cache_and_train_what_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let two = two_ranks_split_the_cache(tmp.path(), "cache_latents_to_disk", "latent_cache");
    let entries = std::fs::read_dir(two.join("out").join("latent_cache"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "safetensors")
        })
        .count();
    assert_eq!(entries, 8, "one entry per image, no probe left");
}

/// With the latent cache in memory, the two ranks each encode half of the 8 images and send each
/// other what they encoded (`latent_exchange`), and train what one process with the same cache
/// does. Catches a rank that trains on another image's latents (an entry filed under the wrong
/// item) or on latents it never received.
#[test]
fn two_ranks_split_the_memory_cache_and_train_what_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    two_ranks_split_the_cache(tmp.path(), "cache_latents", "in memory");
}
