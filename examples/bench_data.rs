//! Throughput of the data path alone: what the trainer's background thread can feed, in images
//! per second, at a real resolution, with the real code (header scan, aspect buckets, epoch plan,
//! [`Prefetcher`] decoding, cropping and resizing, EveryDream2's crop jitter), and the process's
//! peak RSS. Also the old way for comparison: every image decoded up front and held (what
//! sdtrain did before the prefetcher), which is what a 10,000-image set cannot afford.
//!
//! ```text
//! cargo run --release --example make_mixed_images -- target/bench-data/images
//! cargo run --release --example bench_data -- target/bench-data/images [--resolution 512]
//!     [--batch 4] [--steps 200] [--hold-all]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use sdtrain::config::DEFAULT_CROP_JITTER;
use sdtrain::data::epoch_plan::bucket_counts;
use sdtrain::data::prefetch::{decode_sample, DecodeSettings, Prefetcher, SampleJob};
use sdtrain::data::{
    aspect_buckets, epoch_batches, load_data_root, nearest_bucket, ImageMeta, DEFAULT_MAX_PIXELS,
};

struct Args {
    root: PathBuf,
    resolution: usize,
    batch: usize,
    steps: usize,
    hold_all: bool,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        root: PathBuf::new(),
        resolution: 512,
        batch: 4,
        steps: 200,
        hold_all: false,
    };
    let mut root = None;
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match a.as_str() {
            "--resolution" => args.resolution = num("--resolution")?,
            "--batch" => args.batch = num("--batch")?,
            "--steps" => args.steps = num("--steps")?,
            "--hold-all" => args.hold_all = true,
            _ if root.is_none() => root = Some(PathBuf::from(a)),
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    args.root = root.ok_or(
        "usage: bench_data IMAGE_DIR [--resolution N] [--batch N] [--steps N] [--hold-all]",
    )?;
    Ok(args)
}

/// The process's peak resident set (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let t0 = Instant::now();
    let data = match load_data_root(&args.root, false) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {}", sdtrain::error_chain::Chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let scan_s = t0.elapsed().as_secs_f64();
    let buckets = aspect_buckets(args.resolution, 64, None);
    let assigned: Vec<_> = data
        .items
        .iter()
        .map(|i| nearest_bucket(&buckets, i.size.0, i.size.1).unwrap_or(buckets[0]))
        .collect();
    println!(
        "{} images, headers read in {scan_s:.2} s; {} buckets in use at {} px",
        data.items.len(),
        bucket_counts(&assigned).len(),
        args.resolution
    );
    let epoch = epoch_batches(&data, &assigned, args.batch, 0, 0);
    let jobs: Vec<Vec<SampleJob>> = epoch
        .batches
        .iter()
        .take(args.steps)
        .enumerate()
        .map(|(s, mb)| {
            mb.ids
                .iter()
                .enumerate()
                .map(|(k, &item)| SampleJob {
                    item,
                    bucket: assigned[item],
                    seed: (s * 1000 + k) as u64,
                })
                .collect()
        })
        .collect();
    let settings = DecodeSettings {
        crop_jitter: DEFAULT_CROP_JITTER,
        max_pixels: DEFAULT_MAX_PIXELS,
        masks: None,
    };
    let images: usize = jobs.iter().map(Vec::len).sum();
    let t1 = Instant::now();
    if args.hold_all {
        // The old way: every image of the steps decoded at once and kept.
        use rayon::prelude::*;
        let all: Vec<_> = jobs
            .par_iter()
            .flatten()
            .map(|j| decode_sample(&data.items[j.item], j, &settings))
            .collect();
        let bytes: usize = all
            .iter()
            .filter_map(|d| d.as_ref().ok())
            .map(|i| i.pixels.len())
            .sum();
        println!(
            "held {} decoded images: {:.0} MiB of pixels",
            all.len(),
            bytes as f64 / 1048576.0
        );
    } else {
        let items: Arc<[ImageMeta]> = data.items.clone().into();
        let mut p = Prefetcher::spawn(items, jobs, settings, 2);
        while let Some(step) = p.next_step() {
            std::hint::black_box(step);
        }
    }
    let secs = t1.elapsed().as_secs_f64();
    println!(
        "{} {images} images in {secs:.1} s: {:.1} images/s; peak RSS {:.0} MiB",
        if args.hold_all {
            "decode all, hold:"
        } else {
            "prefetcher:"
        },
        images as f64 / secs,
        peak_rss_mib()
    );
    ExitCode::SUCCESS
}
