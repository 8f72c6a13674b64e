//! Full-size SD1.5, SD2.1 and SDXL pipelines from tests/fixtures/full-size/<family>.json (the
//! real components' config.json and tensor shapes, scripts/make_full_size_shapes.py), beside the
//! tiny fixture's scheduler, tokenizers and model_index.json: with sparse, header-only weights
//! for `--dry-run` (tests/presets_cli.rs), or with random weights to train on a card
//! (examples/make_random_model.rs, scripts/gpu-vram-rehearsal).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// What the weights hold.
#[derive(Debug, Clone, Copy)]
pub enum Fill {
    /// Nothing: the files are extended to their length, which the filesystem keeps as a hole.
    Sparse,
    /// Random bf16 values from this seed: norm weights 1, biases 0, other weights
    /// `N(0, 1/fan_in)`.
    RandomBf16(u64),
}

/// Writes the `family` (`sd15`, `sd21`, `sdxl`) pipeline into `dir` (under the repository
/// `root`) and returns it.
pub fn full_size_model(
    root: &Path,
    family: &str,
    dir: &Path,
    fill: Fill,
) -> std::io::Result<PathBuf> {
    let tiny = root.join(format!("tests/fixtures/tiny-{family}"));
    std::fs::create_dir_all(dir)?;
    for entry in std::fs::read_dir(&tiny)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name == "model_index.json" {
            std::fs::copy(&path, dir.join(&name))?;
        } else if name == "scheduler" || name.starts_with("tokenizer") {
            copy_dir(&path, &dir.join(&name))?;
        }
    }
    let shapes = root.join(format!("tests/fixtures/full-size/{family}.json"));
    let shapes: Value = serde_json::from_str(&std::fs::read_to_string(shapes)?)?;
    let components = shapes.as_object().ok_or_else(|| bad("not an object"))?;
    for (component, spec) in components {
        let folder = dir.join(component);
        std::fs::create_dir_all(&folder)?;
        std::fs::write(
            folder.join("config.json"),
            serde_json::to_string_pretty(&spec["config"])?,
        )?;
        let file = folder.join(spec["file"].as_str().ok_or_else(|| bad("no file"))?);
        let tensors = spec["tensors"]
            .as_array()
            .ok_or_else(|| bad("no tensors"))?;
        write_safetensors(&file, tensors, fill)?;
    }
    Ok(dir.to_path_buf())
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("full-size shapes: {what}"),
    )
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let path = entry?.path();
        let target = to.join(path.file_name().unwrap_or_default());
        if path.is_dir() {
            copy_dir(&path, &target)?;
        } else {
            std::fs::copy(&path, &target)?;
        }
    }
    Ok(())
}

/// A safetensors file of `tensors` (`[name, dtype, shape]`, in order): f32 headers and sparse
/// data, or bf16 random data.
fn write_safetensors(path: &Path, tensors: &[Value], fill: Fill) -> std::io::Result<()> {
    let (dtype, bytes) = match fill {
        Fill::Sparse => ("F32", 4u64),
        Fill::RandomBf16(_) => ("BF16", 2),
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    let mut shapes = Vec::with_capacity(tensors.len());
    for t in tensors {
        let name = t[0].as_str().ok_or_else(|| bad("tensor name"))?;
        let shape: Vec<u64> = t[2]
            .as_array()
            .ok_or_else(|| bad("tensor shape"))?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let end = offset + shape.iter().product::<u64>() * bytes;
        header.insert(
            name.into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        shapes.push((name.to_string(), shape));
        offset = end;
    }
    let mut json = serde_json::to_string(&header)?.into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(json.len() as u64).to_le_bytes())?;
    f.write_all(&json)?;
    match fill {
        Fill::Sparse => f.into_inner()?.set_len(8 + json.len() as u64 + offset)?,
        Fill::RandomBf16(seed) => {
            for (i, (name, shape)) in shapes.iter().enumerate() {
                f.write_all(&random_bf16(name, shape, seed.wrapping_add(i as u64)))?;
            }
            f.flush()?;
        }
    }
    Ok(())
}

/// A tensor's random bf16 bytes: norm weights 1, biases 0, other weights `N(0, 1/fan_in)`.
fn random_bf16(name: &str, shape: &[u64], seed: u64) -> Vec<u8> {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let n = shape.iter().product::<u64>() as usize;
    let norm = name.contains("norm") || name.contains("ln_");
    let value: Box<dyn Fn(&mut rand::rngs::StdRng) -> f32> = if name.ends_with("bias") {
        Box::new(|_| 0.0)
    } else if norm && shape.len() == 1 {
        Box::new(|_| 1.0)
    } else {
        let fan_in = shape.iter().skip(1).product::<u64>().max(1) as f32;
        let dist = rand_distr::Normal::new(0.0f32, fan_in.sqrt().recip()).unwrap_or_else(|_| {
            rand_distr::Normal::new(0.0, 0.02).expect("a valid normal distribution")
        });
        Box::new(move |rng| dist.sample(rng))
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        out.extend_from_slice(&half::bf16::from_f32(value(&mut rng)).to_le_bytes());
    }
    out
}
