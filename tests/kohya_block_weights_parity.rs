//! kohya's block-wise LoRA settings and block indices, against kohya's own functions
//! (tests/fixtures/kohya_block_weights_reference.py → reference/kohya_block_weights.json).

use sdtrain::adapter::block_weights::{block_index, parse_numbers, BlockSettings, LrWeights};
use sdtrain::adapter::kohya_names::{KohyaComponent, KohyaNaming, UnetLayout};
use serde_json::Value;

fn reference() -> Value {
    let text = std::fs::read_to_string("tests/fixtures/reference/kohya_block_weights.json")
        .expect("reference json");
    serde_json::from_str(&text).unwrap()
}

fn ints(text: &str) -> Vec<usize> {
    parse_numbers(text)
        .unwrap()
        .into_iter()
        .map(|v| v as usize)
        .collect()
}

/// The settings a case's kohya `network_args` strings give.
fn settings(args: &Value) -> BlockSettings {
    let s = |k: &str| args.get(k).and_then(Value::as_str);
    BlockSettings {
        dims: s("block_dims").map(ints),
        alphas: s("block_alphas").map(|t| parse_numbers(t).unwrap()),
        conv_dims: s("conv_block_dims").map(ints),
        conv_alphas: s("conv_block_alphas").map(|t| parse_numbers(t).unwrap()),
        down_lr_weight: s("down_lr_weight").map(|t| LrWeights::parse(t).unwrap()),
        mid_lr_weight: s("mid_lr_weight").map(|t| parse_numbers(t).unwrap()),
        up_lr_weight: s("up_lr_weight").map(|t| LrWeights::parse(t).unwrap()),
        zero_threshold: s("block_lr_zero_threshold").map_or(0.0, |t| t.parse().unwrap()),
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
}

#[test]
fn block_ranks_alphas_and_weights_are_kohyas() {
    let r = reference();
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 12);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let sdxl = case["sdxl"].as_bool().unwrap();
        let base = (
            case["rank"].as_u64().unwrap() as usize,
            case["alpha"].as_f64().unwrap(),
        );
        let conv = case["conv_rank"]
            .as_u64()
            .map(|r| (r as usize, case["conv_alpha"].as_f64().unwrap()));
        let (table, _) = settings(&case["args"])
            .resolve(sdxl, base, conv)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = &case["expected"];
        let want_dims: Vec<usize> = floats(&want["dims"]).iter().map(|&d| d as usize).collect();
        assert_eq!(table.dims, want_dims, "{name}: dims");
        assert!(
            close(&table.alphas, &floats(&want["alphas"])),
            "{name}: alphas"
        );
        match (&table.conv, want["conv_dims"].is_null()) {
            (None, true) => {}
            (Some((d, a)), false) => {
                let wd: Vec<usize> = floats(&want["conv_dims"])
                    .iter()
                    .map(|&d| d as usize)
                    .collect();
                assert_eq!(d, &wd, "{name}: conv dims");
                assert!(
                    close(a, &floats(&want["conv_alphas"])),
                    "{name}: conv alphas"
                );
            }
            (got, _) => panic!("{name}: conv {got:?}, kohya {}", want["conv_dims"]),
        }
        match (&table.lr_weight, want["lr_weight"].is_null()) {
            (None, true) => {}
            (Some(w), false) => assert!(
                close(w, &floats(&want["lr_weight"])),
                "{name}: lr weights {w:?}, kohya {}",
                want["lr_weight"]
            ),
            (got, _) => panic!("{name}: lr weights {got:?}, kohya {}", want["lr_weight"]),
        }
    }
}

/// The full-size UNet's Linear and Conv2d paths inside its blocks.
fn unet_paths(family: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("tests/fixtures/full-size/{family}.json")).unwrap();
    let full: Value = serde_json::from_str(&text).unwrap();
    full["unet"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| {
            let name = t[0].as_str()?;
            let dims = t[2].as_array()?.len();
            let in_blocks = ["down_blocks.", "mid_block.", "up_blocks."]
                .iter()
                .any(|p| name.starts_with(p));
            (in_blocks && matches!(dims, 2 | 4))
                .then(|| name.strip_suffix(".weight").map(str::to_string))
                .flatten()
        })
        .collect()
}

#[test]
fn every_sd15_and_sdxl_module_is_in_kohyas_block() {
    let r = reference();
    let cases = [
        ("sd15", KohyaNaming::Diffusers, false),
        ("sdxl", KohyaNaming::Ldm(UnetLayout::sdxl_base()), true),
    ];
    for (family, naming, sdxl) in cases {
        let want = r["block_index"][family].as_object().unwrap();
        let paths = unet_paths(family);
        assert_eq!(paths.len(), want.len(), "{family}: module count");
        for path in paths {
            let name = naming.module_name(KohyaComponent::Unet, &path).unwrap();
            // kohya keys SD1.5 by the diffusers path, SDXL by its own name.
            let key = if sdxl { name.clone() } else { path.clone() };
            let expected = want
                .get(&key)
                .unwrap_or_else(|| panic!("{family}: kohya has no {key}"))
                .as_i64()
                .unwrap();
            let got = block_index(&name, sdxl).map_or(-1, |i| i as i64);
            assert_eq!(got, expected, "{family}: {path} ({name})");
        }
    }
}
