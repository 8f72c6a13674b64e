//! Writes the demo dataset that `configs/demo-tiny.json` trains on: eight 64×64 PNGs of simple
//! coloured shapes, each with a `.txt` caption. The output is fully deterministic (no RNG, fixed
//! geometry), so rerunning it reproduces the committed `data/demo/` byte for byte.
//!
//! ```text
//! cargo run --example make_demo_data            # writes data/demo/
//! cargo run --example make_demo_data -- OUT_DIR
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use image::{Rgb, RgbImage};

const SIZE: u32 = 64;

#[derive(Clone, Copy)]
enum Shape {
    Circle,
    Square,
    Triangle,
    Stripes,
}

const RED: [u8; 3] = [220, 40, 40];
const GREEN: [u8; 3] = [40, 170, 60];
const BLUE: [u8; 3] = [40, 70, 210];
const YELLOW: [u8; 3] = [240, 210, 40];
const WHITE: [u8; 3] = [245, 245, 245];
const BLACK: [u8; 3] = [20, 20, 20];

/// One demo image: its file stem, what is drawn, and its caption.
struct Demo {
    stem: &'static str,
    shape: Shape,
    fg: [u8; 3],
    bg: [u8; 3],
    caption: &'static str,
}

const fn demo(
    stem: &'static str,
    shape: Shape,
    fg: [u8; 3],
    bg: [u8; 3],
    caption: &'static str,
) -> Demo {
    Demo {
        stem,
        shape,
        fg,
        bg,
        caption,
    }
}

const IMAGES: [Demo; 8] = [
    demo(
        "red_circle",
        Shape::Circle,
        RED,
        BLUE,
        "a red circle on a blue background",
    ),
    demo(
        "yellow_circle",
        Shape::Circle,
        YELLOW,
        BLACK,
        "a yellow circle on a black background",
    ),
    demo(
        "green_square",
        Shape::Square,
        GREEN,
        WHITE,
        "a green square on a white background",
    ),
    demo(
        "blue_square",
        Shape::Square,
        BLUE,
        YELLOW,
        "a blue square on a yellow background",
    ),
    demo(
        "white_triangle",
        Shape::Triangle,
        WHITE,
        RED,
        "a white triangle on a red background",
    ),
    demo(
        "black_triangle",
        Shape::Triangle,
        BLACK,
        GREEN,
        "a black triangle on a green background",
    ),
    demo(
        "red_stripes",
        Shape::Stripes,
        RED,
        WHITE,
        "red and white vertical stripes",
    ),
    demo(
        "blue_stripes",
        Shape::Stripes,
        BLUE,
        YELLOW,
        "blue and yellow vertical stripes",
    ),
];

/// Whether pixel `(x, y)` (centre-sampled) belongs to `shape`.
fn inside(shape: Shape, x: u32, y: u32) -> bool {
    let (fx, fy) = (x as f32 + 0.5, y as f32 + 0.5);
    let c = SIZE as f32 / 2.0;
    match shape {
        Shape::Circle => (fx - c).powi(2) + (fy - c).powi(2) <= 20.0f32.powi(2),
        Shape::Square => (14..50).contains(&x) && (14..50).contains(&y),
        // Apex at the top centre, base along y = 52.
        Shape::Triangle => (12.0..=52.0).contains(&fy) && (fx - c).abs() <= (fy - 12.0) * 0.55,
        Shape::Stripes => (x / 8).is_multiple_of(2),
    }
}

fn render(shape: Shape, fg: [u8; 3], bg: [u8; 3]) -> RgbImage {
    RgbImage::from_fn(SIZE, SIZE, |x, y| {
        Rgb(if inside(shape, x, y) { fg } else { bg })
    })
}

fn main() -> ExitCode {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/demo"));
    if let Err(err) = std::fs::create_dir_all(&out) {
        eprintln!("error: cannot create {}: {err}", out.display());
        return ExitCode::FAILURE;
    }
    for d in &IMAGES {
        let png = out.join(format!("{}.png", d.stem));
        let txt = out.join(format!("{}.txt", d.stem));
        if let Err(err) = render(d.shape, d.fg, d.bg).save(&png) {
            eprintln!("error: cannot write {}: {err}", png.display());
            return ExitCode::FAILURE;
        }
        if let Err(err) = std::fs::write(&txt, format!("{}\n", d.caption)) {
            eprintln!("error: cannot write {}: {err}", txt.display());
            return ExitCode::FAILURE;
        }
    }
    println!("wrote {} images to {}", IMAGES.len(), out.display());
    ExitCode::SUCCESS
}
