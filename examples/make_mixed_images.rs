//! Writes a synthetic dataset for data-pipeline benchmarks (`scripts/bench-data`): COUNT images
//! of mixed sizes, aspect ratios and formats, each with a caption `.txt` of comma-separated tags.
//!
//! ```text
//! cargo run --release --example make_mixed_images -- OUT_DIR [--count 2000] [--seed 0]
//! ```
//!
//! - Size: the long side is log-uniform in [300, 2000] px (median about 775 px; 0.72 megapixels
//!   an image on average): scraped sets hold more small images than large ones.
//! - Aspect ratio (width:height): 88% from a table of the common ones (1:1, 4:3, 3:4, 3:2, 2:3,
//!   16:9, 9:16, 5:4, 4:5) and the extremes (2:1 … 4:1 and 1:2 … 1:4, 21:9, 9:21); the other 12%
//!   log-uniform in [1:4, 4:1], so buckets also see ratios that match no table entry.
//! - Format: 85% JPEG at quality 90 (camera-like: a gradient, a few shapes and grain, so the file
//!   sizes are near a photo's), 15% PNG (illustration-like: little or no grain, fast deflate).
//! - Content: a two-colour linear gradient at a random angle, 1–6 filled circles and rectangles,
//!   and per-pixel grain from a xorshift stream. Cheap on purpose: writing is dominated by the
//!   encoders, so 2,000 images take seconds, not minutes.
//!
//! Deterministic: image `i` draws from its own `StdRng` seeded from `(seed, i)`, so the output is
//! the same byte for byte whatever the thread count (files are written in parallel with rayon).
//! Names are `mixed_00000.jpg` / `.png` with `mixed_00000.txt` beside.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::{ExtendedColorType, ImageEncoder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

#[derive(Debug, Parser)]
#[command(about = "Write a synthetic dataset of mixed sizes, aspect ratios and formats")]
struct Args {
    /// The folder to write into (created if missing; existing files with the same names are
    /// overwritten).
    out_dir: PathBuf,
    /// How many images.
    #[arg(long, default_value_t = 2000)]
    count: usize,
    /// Seed of the whole set.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

const LONG_SIDE: (u32, u32) = (300, 2000);
const JPEG_QUALITY: u8 = 90;
/// Fraction of the images written as PNG.
const PNG_SHARE: f64 = 0.15;
/// Fraction of the aspect ratios drawn log-uniformly instead of from [`RATIOS`].
const FREE_RATIO_SHARE: f64 = 0.12;
/// The widest ratio either way (4:1 and 1:4).
const MAX_RATIO: f64 = 4.0;
/// Entries of the gradient's colour table.
const GRADIENT_STEPS: usize = 1024;

/// (width, height, relative weight): common camera and screen ratios most often, extremes
/// (panoramas, phone screenshots, banners) now and then.
const RATIOS: &[(u32, u32, u32)] = &[
    (1, 1, 20),
    (4, 3, 9),
    (3, 4, 9),
    (3, 2, 8),
    (2, 3, 8),
    (16, 9, 8),
    (9, 16, 8),
    (5, 4, 3),
    (4, 5, 3),
    (2, 1, 3),
    (1, 2, 3),
    (21, 9, 2),
    (9, 21, 2),
    (3, 1, 2),
    (1, 3, 2),
    (4, 1, 1),
    (1, 4, 1),
];

/// Named colours for the gradient ends and the shapes, so captions can say what is drawn.
const PALETTE: &[(&str, [u8; 3])] = &[
    ("red", [200, 40, 40]),
    ("orange", [235, 130, 30]),
    ("yellow", [235, 210, 50]),
    ("green", [50, 160, 70]),
    ("teal", [30, 140, 140]),
    ("blue", [40, 80, 200]),
    ("purple", [120, 60, 170]),
    ("pink", [230, 120, 170]),
    ("brown", [120, 80, 40]),
    ("white", [240, 240, 235]),
    ("gray", [128, 128, 128]),
    ("black", [25, 25, 30]),
];

const MOODS: &[&str] = &[
    "soft light",
    "geometric",
    "minimal",
    "bold",
    "pastel",
    "high contrast",
    "muted",
    "vivid",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Jpeg,
    Png,
}

impl Format {
    fn extension(self) -> &'static str {
        match self {
            Format::Jpeg => "jpg",
            Format::Png => "png",
        }
    }
}

/// One shape, in pixel coordinates.
#[derive(Clone, Copy)]
enum Shape {
    Circle { cx: f32, cy: f32, r: f32 },
    Rect { x0: u32, y0: u32, x1: u32, y1: u32 },
}

/// Everything drawn in one image, decided up front from its RNG.
struct Plan {
    width: u32,
    height: u32,
    format: Format,
    from: usize,
    to: usize,
    /// Unit direction of the gradient.
    dir: (f32, f32),
    shapes: Vec<(Shape, usize)>,
    /// Grain amplitude: each channel gets ± this much.
    grain: u8,
    mood: &'static str,
}

/// The RNG of image `index`: seeded from the set's seed and the index only, so each image is
/// the same whichever thread draws it.
fn image_rng(seed: u64, index: usize) -> StdRng {
    StdRng::seed_from_u64(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Width over height.
fn pick_ratio(rng: &mut StdRng) -> f64 {
    if rng.random_bool(FREE_RATIO_SHARE) {
        return MAX_RATIO.powf(rng.random_range(-1.0..=1.0));
    }
    let total: u32 = RATIOS.iter().map(|r| r.2).sum();
    let mut pick = rng.random_range(0..total);
    for &(w, h, weight) in RATIOS {
        if pick < weight {
            return f64::from(w) / f64::from(h);
        }
        pick -= weight;
    }
    1.0
}

fn plan(rng: &mut StdRng) -> Plan {
    let (lo, hi) = (f64::from(LONG_SIDE.0), f64::from(LONG_SIDE.1));
    let long = (lo * (hi / lo).powf(rng.random_range(0.0..=1.0))).round() as u32;
    let ratio = pick_ratio(rng);
    let short = |r: f64| ((f64::from(long) / r).round() as u32).max(1);
    let (width, height) = if ratio >= 1.0 {
        (long, short(ratio))
    } else {
        (short(1.0 / ratio), long)
    };
    let format = if rng.random_bool(PNG_SHARE) {
        Format::Png
    } else {
        Format::Jpeg
    };
    let from = rng.random_range(0..PALETTE.len());
    let to = (from + rng.random_range(1..PALETTE.len())) % PALETTE.len();
    let angle = rng.random_range(0.0..std::f32::consts::TAU);
    let n_shapes = rng.random_range(1..=6);
    let shapes = (0..n_shapes)
        .map(|_| {
            (
                random_shape(rng, width, height),
                rng.random_range(0..PALETTE.len()),
            )
        })
        .collect();
    let grain = match format {
        Format::Jpeg => rng.random_range(2..=10),
        Format::Png => rng.random_range(0..=2),
    };
    Plan {
        width,
        height,
        format,
        from,
        to,
        dir: (angle.cos(), angle.sin()),
        shapes,
        grain,
        mood: MOODS[rng.random_range(0..MOODS.len())],
    }
}

fn random_shape(rng: &mut StdRng, width: u32, height: u32) -> Shape {
    let (w, h) = (width as f32, height as f32);
    let short = w.min(h);
    if rng.random_bool(0.5) {
        Shape::Circle {
            cx: rng.random_range(0.0..w),
            cy: rng.random_range(0.0..h),
            r: rng.random_range(0.05..0.35) * short,
        }
    } else {
        let rw = (rng.random_range(0.1..0.6) * w) as u32;
        let rh = (rng.random_range(0.1..0.6) * h) as u32;
        let x0 = rng.random_range(0..width.saturating_sub(rw).max(1));
        let y0 = rng.random_range(0..height.saturating_sub(rh).max(1));
        Shape::Rect {
            x0,
            y0,
            x1: (x0 + rw).min(width),
            y1: (y0 + rh).min(height),
        }
    }
}

/// RGB8 pixels, row-major.
fn render(p: &Plan, noise_seed: u32) -> Vec<u8> {
    let (w, h) = (p.width as usize, p.height as usize);
    let mut px = vec![0u8; w * h * 3];
    // The gradient's colours, looked up by t = (x·dx + y·dy − lo) / (hi − lo), which runs 0→1
    // across the image: a table lookup per pixel instead of three lerps.
    let (a, b) = (PALETTE[p.from].1, PALETTE[p.to].1);
    let lut: Vec<[u8; 3]> = (0..GRADIENT_STEPS)
        .map(|i| {
            let t = i as f32 / (GRADIENT_STEPS - 1) as f32;
            std::array::from_fn(|c| {
                (f32::from(a[c]) + (f32::from(b[c]) - f32::from(a[c])) * t).round() as u8
            })
        })
        .collect();
    let corners = [
        (0.0, 0.0),
        (w as f32, 0.0),
        (0.0, h as f32),
        (w as f32, h as f32),
    ];
    let proj = |(x, y): (f32, f32)| x * p.dir.0 + y * p.dir.1;
    let lo = corners.iter().map(|&c| proj(c)).fold(f32::MAX, f32::min);
    let hi = corners.iter().map(|&c| proj(c)).fold(f32::MIN, f32::max);
    let scale = (GRADIENT_STEPS - 1) as f32 / (hi - lo).max(1.0);
    let top = GRADIENT_STEPS - 1;
    for (y, row) in px.chunks_exact_mut(w * 3).enumerate() {
        let base = (y as f32 * p.dir.1 - lo) * scale;
        let step = p.dir.0 * scale;
        for (x, pixel) in row.chunks_exact_mut(3).enumerate() {
            let i = (base + x as f32 * step) as usize;
            pixel.copy_from_slice(&lut[i.min(top)]);
        }
    }
    for &(shape, colour) in &p.shapes {
        fill(&mut px, w, h, shape, PALETTE[colour].1);
    }
    add_grain(&mut px, p.grain, noise_seed);
    px
}

fn fill(px: &mut [u8], w: usize, h: usize, shape: Shape, colour: [u8; 3]) {
    let mut span = |y: usize, x0: usize, x1: usize| {
        for pixel in px[(y * w + x0) * 3..(y * w + x1) * 3].chunks_exact_mut(3) {
            pixel.copy_from_slice(&colour);
        }
    };
    match shape {
        Shape::Rect { x0, y0, x1, y1 } => {
            for y in y0 as usize..y1 as usize {
                span(y, x0 as usize, x1 as usize);
            }
        }
        Shape::Circle { cx, cy, r } => {
            let top = (cy - r).max(0.0) as usize;
            let bottom = ((cy + r).ceil() as usize).min(h);
            for y in top..bottom {
                let dy = y as f32 + 0.5 - cy;
                let half = (r * r - dy * dy).max(0.0).sqrt();
                let x0 = (cx - half).clamp(0.0, w as f32) as usize;
                let x1 = (cx + half).clamp(0.0, w as f32) as usize;
                span(y, x0, x1);
            }
        }
    }
}

/// Adds the same ±`amp` to the three channels of each pixel (luma grain, like a camera's) from a
/// xorshift32 stream: cheap, and enough to make JPEG sizes photo-like instead of near-empty.
fn add_grain(px: &mut [u8], amp: u8, seed: u32) {
    if amp == 0 {
        return;
    }
    let (amp, levels) = (i16::from(amp), u32::from(amp) * 2 + 1);
    let mut s = seed | 1;
    for pixel in px.chunks_exact_mut(3) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        // Multiply-shift maps 16 random bits onto 0..levels without a division.
        let d = (((s >> 16) * levels) >> 16) as i16 - amp;
        for v in pixel {
            *v = (i16::from(*v) + d).clamp(0, 255) as u8;
        }
    }
}

fn caption(p: &Plan) -> String {
    let ratio = f64::from(p.width) / f64::from(p.height);
    let orientation = match ratio {
        r if r >= 2.0 => "panorama",
        r if r > 1.05 => "landscape",
        r if r >= 1.0 / 1.05 => "square",
        r if r > 0.5 => "portrait",
        _ => "tall banner",
    };
    let circles = p
        .shapes
        .iter()
        .filter(|s| matches!(s.0, Shape::Circle { .. }))
        .count();
    let rects = p.shapes.len() - circles;
    let count = |n: usize, noun: &str| match n {
        1 => format!("one {noun}"),
        n => format!("{n} {noun}s"),
    };
    let mut tags = vec![
        "abstract".to_string(),
        format!("{} to {} gradient", PALETTE[p.from].0, PALETTE[p.to].0),
    ];
    if circles > 0 {
        tags.push(count(circles, "circle"));
    }
    if rects > 0 {
        tags.push(count(rects, "rectangle"));
    }
    tags.push(orientation.to_string());
    tags.push(p.mood.to_string());
    if p.grain >= 8 {
        tags.push("film grain".to_string());
    }
    tags.join(", ")
}

fn encode(path: &Path, p: &Plan, px: &[u8]) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::new(file);
    match p.format {
        Format::Jpeg => JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY).write_image(
            px,
            p.width,
            p.height,
            ExtendedColorType::Rgb8,
        ),
        Format::Png => {
            PngEncoder::new_with_quality(&mut out, CompressionType::Fast, FilterType::Adaptive)
                .write_image(px, p.width, p.height, ExtendedColorType::Rgb8)
        }
    }
    .with_context(|| format!("cannot encode {}", path.display()))?;
    out.flush()
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Writes image `index` and its caption; returns the bytes written.
fn write_one(out: &Path, seed: u64, index: usize) -> Result<(Format, u64)> {
    let mut rng = image_rng(seed, index);
    let p = plan(&mut rng);
    let px = render(&p, rng.random());
    let stem = format!("mixed_{index:05}");
    let image_path = out.join(format!("{stem}.{}", p.format.extension()));
    encode(&image_path, &p, &px)?;
    let text_path = out.join(format!("{stem}.txt"));
    let text = format!("{}\n", caption(&p));
    std::fs::write(&text_path, &text)
        .with_context(|| format!("cannot write {}", text_path.display()))?;
    let image_bytes = std::fs::metadata(&image_path)
        .with_context(|| format!("cannot stat {}", image_path.display()))?
        .len();
    Ok((p.format, image_bytes + text.len() as u64))
}

fn run(args: &Args) -> Result<()> {
    let started = Instant::now();
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("cannot create {}", args.out_dir.display()))?;
    let bytes = AtomicU64::new(0);
    let pngs = AtomicUsize::new(0);
    (0..args.count).into_par_iter().try_for_each(|i| {
        let (format, n) = write_one(&args.out_dir, args.seed, i)?;
        bytes.fetch_add(n, Ordering::Relaxed);
        if format == Format::Png {
            pngs.fetch_add(1, Ordering::Relaxed);
        }
        anyhow::Ok(())
    })?;
    let (bytes, pngs) = (bytes.into_inner(), pngs.into_inner());
    println!(
        "wrote {} images ({} JPEG, {} PNG) and {} captions to {}: {} files, {} bytes ({:.1} MiB) \
         in {:.1} s",
        args.count,
        args.count - pngs,
        pngs,
        args.count,
        args.out_dir.display(),
        2 * args.count,
        bytes,
        bytes as f64 / (1024.0 * 1024.0),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
