//! Full-size SD1.5, SD2.1 and SDXL pipelines without their weights, for `--dry-run`: each
//! component's real config.json and safetensors files with the real headers (names, dtypes,
//! shapes, offsets) and sparse, all-zero data, so a 10 GB UNet costs a few hundred KiB of disk.
//! The shapes come from tests/fixtures/full-size/<family>.json (scripts/make_full_size_shapes.py);
//! the scheduler, tokenizers and model_index.json from the tiny fixture of the same family.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Writes the `family` (`sd15`, `sd21`, `sdxl`) pipeline into `dir` and returns it.
pub fn full_size_model(family: &str, dir: &Path) -> PathBuf {
    let tiny = super::fixture(&format!("tiny-{family}"));
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(&tiny).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "model_index.json" {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        } else if name == "scheduler" || name.starts_with("tokenizer") {
            super::copy_dir(&path, &dir.join(&name));
        }
    }
    let shapes = super::repo_root().join(format!("tests/fixtures/full-size/{family}.json"));
    let shapes: Value = serde_json::from_str(&std::fs::read_to_string(shapes).unwrap()).unwrap();
    for (component, spec) in shapes.as_object().unwrap() {
        let folder = dir.join(component);
        std::fs::create_dir_all(&folder).unwrap();
        let config = serde_json::to_string_pretty(&spec["config"]).unwrap();
        std::fs::write(folder.join("config.json"), config).unwrap();
        let file = folder.join(spec["file"].as_str().unwrap());
        write_sparse_safetensors(&file, spec["tensors"].as_array().unwrap());
    }
    dir.to_path_buf()
}

/// A safetensors file with `tensors` (`[name, dtype, shape]`) in order and no data written:
/// the file is extended to its full length, which the filesystem keeps as a hole.
fn write_sparse_safetensors(path: &Path, tensors: &[Value]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for t in tensors {
        let (name, dtype, shape) = (t[0].as_str().unwrap(), t[1].as_str().unwrap(), &t[2]);
        let bytes: u64 = match dtype {
            "F32" => 4,
            "F16" | "BF16" => 2,
            other => panic!("{other}"),
        };
        let n: u64 = shape
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        let end = offset + n * bytes;
        header.insert(
            name.into(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::to_string(&header).unwrap().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&json).unwrap();
    f.set_len(8 + json.len() as u64 + offset).unwrap();
}
