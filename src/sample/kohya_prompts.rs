//! kohya sd-scripts' sample prompt formats (`library/train_util.py`: `load_prompts`,
//! `line_to_prompt_dict`, `get_my_scheduler`), read so a kohya user's prompts file draws the
//! same prompts here:
//! - a `.txt` line is the prompt, then options after ` --`: `--n` negative prompt, `--w` and
//!   `--h` size in pixels, `--d` seed, `--s` steps (kept within 1 to 1000, as kohya does), `--l`
//!   guidance scale, `--ss` sampler. Option names are read in any case. Lines starting with `#`
//!   are comments;
//! - a `.json` file that is a list holds, per prompt, a line as above or an object with the
//!   keys `prompt`, `negative_prompt`, `width`, `height`, `seed`, `sample_steps`, `scale` and
//!   `sample_sampler`;
//! - a `.toml` file holds a `[prompt]` table of defaults (the same keys) and one
//!   `[[prompt.subset]]` table per prompt, each read over the defaults.
//!
//! Such a file's prompts are weighted as kohya's samples weight them (A1111's `(words:1.3)`,
//! [`super::kohya_weighting`]); [`looks_like_kohya`] tells a `.txt` of kohya's from
//! EveryDream2's (whose samples read compel's syntax).
//!
//! Differences, each deliberate:
//! - kohya ignores an option it does not know (a prompt holding ` --` loses the rest of its
//!   text) and falls back to DDIM for a sampler it does not know; both are errors here, naming
//!   the line or entry;
//! - a `[[prompt.subset]]` key that `[prompt]` also sets overrides it (kohya's
//!   `dict(**prompt, **subset)` stops with a `TypeError`); keys outside `[prompt]` are refused
//!   (kohya ignores them);
//! - options for other model types (`--g` guidance for Flux, `--cn` ControlNet image, `--ctr`,
//!   `--rcfg`, `--fs`) are refused rather than ignored;
//! - without `--w`/`--h` a sample takes the run's resolution (kohya: 512), and a side alone
//!   keeps the other at it; without `--d` the file's or run's seed (kohya: a fresh seed);
//! - the sampler is built from the model's scheduler config, as every sdtrain sample is (kohya
//!   builds it from SD1's constants). kohya's `heun`, `dpm_2` (not ancestral) and `dpmsolver`
//!   (not ++) are not samplers sdtrain has, and are refused.

use serde_json::{Map, Value};

use super::prompts::{PromptText, SamplePrompt, SeedChoice, SizeChoice};
use super::sampler::SamplerKind;

/// kohya's options that sdtrain's samples cannot honour, with what they are for.
const REFUSED: &[(&str, &str)] = &[
    ("g", "Flux's distilled guidance scale"),
    ("cn", "a ControlNet image"),
    ("ctr", "CFG truncation, for Lumina"),
    ("rcfg", "CFG renormalisation, for Lumina"),
    ("fs", "flow shift, for flow-matching models"),
];

/// Whether a `.txt` prompts file is kohya's: a line with kohya's options or a `#` comment, or a
/// prompt with A1111's `(words:1.3)` weights (which EveryDream2's compel reads as text).
pub fn looks_like_kohya(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .any(|l| is_comment(l) || l.contains(" --") || super::a1111_syntax::has_explicit_weight(l))
}

/// Whether a `.txt` line is a comment (kohya skips lines starting with `#`).
pub fn is_comment(line: &str) -> bool {
    line.starts_with('#')
}

/// One `.txt` line (already trimmed and not blank): the prompt and its options.
pub fn parse_line(line: &str) -> Result<SamplePrompt, String> {
    let mut parts = line.split(" --");
    let mut p = empty(parts.next().unwrap_or_default().trim());
    let (mut width, mut height) = (None, None);
    for part in parts {
        let (key, value) = part.split_once(' ').unwrap_or((part, ""));
        let (key, value) = (key.to_ascii_lowercase(), value.trim());
        let need = |what: &str| match value.is_empty() {
            true => Err(format!("`--{key}` needs {what}")),
            false => Ok(value),
        };
        match key.as_str() {
            "n" => p.negative_prompt = value.to_string(),
            "w" => width = Some(pixels(&key, need("a width in pixels")?)?),
            "h" => height = Some(pixels(&key, need("a height in pixels")?)?),
            "d" => p.seed = Some(SeedChoice::Fixed(number(&key, need("a seed")?)?)),
            "s" => p.steps = Some(number::<usize>(&key, need("a step count")?)?.clamp(1, 1000)),
            "l" => p.cfgs = Some(vec![scale(&key, need("a guidance scale")?)?]),
            "ss" => p.sampler = Some(sampler(need("a sampler name")?)?),
            other => return Err(unknown_option(other)),
        }
    }
    p.size = size(width, height);
    Ok(p)
}

/// The entries of a kohya `.json` prompts file (a list): each a line or an object.
pub fn parse_list(items: &[Value]) -> Result<Vec<SamplePrompt>, String> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            match item {
                Value::String(line) => parse_line(line.trim()),
                Value::Object(obj) => parse_object(obj),
                _ => Err("is neither a prompt line nor an object".to_string()),
            }
            .map_err(|e| format!("entry {i} {e}"))
        })
        .collect()
}

/// The prompts of a kohya `.toml` file: each `[[prompt.subset]]` over the `[prompt]` defaults.
pub fn parse_toml(text: &str) -> Result<Vec<SamplePrompt>, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| format!("is not valid TOML: {e}"))?;
    let root = serde_json::to_value(table).map_err(|e| format!("is not readable: {e}"))?;
    let root = root.as_object().ok_or("is not a TOML table")?;
    if let Some(k) = root.keys().find(|k| *k != "prompt") {
        return Err(format!(
            "has `{k}`; kohya's prompt files hold a `[prompt]` table and its \
             `[[prompt.subset]]` entries"
        ));
    }
    let defaults = match root.get("prompt") {
        Some(Value::Object(o)) => o,
        Some(_) => return Err("has `prompt`, which is not a table".into()),
        None => {
            return Err(
                "has no `[prompt]` table; kohya's prompt files hold one, with a \
                 `[[prompt.subset]]` entry per prompt"
                    .into(),
            )
        }
    };
    let subsets = match defaults.get("subset") {
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err("`prompt.subset` is not a list of `[[prompt.subset]]` tables".into())
        }
        None => return Err("has no `[[prompt.subset]]` entry (one per prompt)".into()),
    };
    subsets
        .iter()
        .enumerate()
        .map(|(i, subset)| {
            let Value::Object(own) = subset else {
                return Err(format!("`prompt.subset` {i} is not a table"));
            };
            let mut merged: Map<String, Value> = defaults
                .iter()
                .filter(|(k, _)| *k != "subset")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            merged.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
            parse_object(&merged).map_err(|e| format!("`[[prompt.subset]]` {i} {e}"))
        })
        .collect()
}

/// One object of a kohya `.json` list.
fn parse_object(obj: &Map<String, Value>) -> Result<SamplePrompt, String> {
    const KEYS: &[&str] = &[
        "prompt",
        "negative_prompt",
        "width",
        "height",
        "seed",
        "sample_steps",
        "scale",
        "sample_sampler",
    ];
    if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!(
            "has `{k}`, which is not one of kohya's sample keys sdtrain reads ({})",
            KEYS.join(", ")
        ));
    }
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let text = |k: &str| -> Result<String, String> {
        match get(k) {
            None => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("`{k}` is not a string")),
        }
    };
    let int = |k: &str| -> Result<Option<u64>, String> {
        get(k)
            .map(|v| v.as_u64().ok_or(format!("`{k}` is not a whole number ≥ 0")))
            .transpose()
    };
    let mut p = empty(&text("prompt")?);
    p.negative_prompt = text("negative_prompt")?;
    let side = |k: &str| -> Result<Option<usize>, String> {
        match int(k)? {
            Some(0) => Err(format!("`{k}` must be positive")),
            v => Ok(v.map(|v| v as usize)),
        }
    };
    p.size = size(side("width")?, side("height")?);
    p.seed = int("seed")?.map(SeedChoice::Fixed);
    p.steps = int("sample_steps")?.map(|s| (s as usize).clamp(1, 1000));
    if let Some(v) = get("scale") {
        let s = v.as_f64().ok_or("`scale` is not a number")?;
        p.cfgs = Some(vec![scale("scale", &s.to_string())?]);
    }
    if get("sample_sampler").is_some() {
        p.sampler = Some(sampler(&text("sample_sampler")?)?);
    }
    Ok(p)
}

fn empty(prompt: &str) -> SamplePrompt {
    SamplePrompt::plain(PromptText::Text(prompt.to_string()))
}

fn size(width: Option<usize>, height: Option<usize>) -> SizeChoice {
    match (width, height) {
        (None, None) => SizeChoice::Default,
        (Some(w), Some(h)) => SizeChoice::Exact(w, h),
        (w, h) => SizeChoice::Sides(w, h),
    }
}

fn number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("`--{key} {value}` is not a whole number ≥ 0"))
}

fn pixels(key: &str, value: &str) -> Result<usize, String> {
    match number::<usize>(key, value)? {
        0 => Err(format!("`--{key}` must be positive")),
        n => Ok(n),
    }
}

fn scale(key: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err(format!("`{key}` {value} is not a guidance scale ≥ 0")),
    }
}

/// kohya's sampler names (`get_my_scheduler`), then sdtrain's own.
pub fn sampler(name: &str) -> Result<SamplerKind, String> {
    let kind = match name.to_ascii_lowercase().as_str() {
        "k_lms" => SamplerKind::parse("lms"),
        "k_euler" => SamplerKind::parse("euler"),
        "k_euler_a" => SamplerKind::parse("euler_a"),
        "dpmsolver++" => SamplerKind::parse("dpm++_2m"),
        "dpmsingle" => SamplerKind::parse("dpm++_2s"),
        "dpm_2_a" | "k_dpm_2_a" => SamplerKind::parse("kdpm2"),
        "heun" | "dpm_2" | "k_dpm_2" | "dpmsolver" => {
            return Err(format!(
                "sampler `{name}` (kohya's) is not one sdtrain has; the samplers are {}",
                SamplerKind::NAMES
            ))
        }
        other => SamplerKind::parse(other),
    };
    kind.ok_or_else(|| format!("sampler {}", SamplerKind::unknown(name)))
}

fn unknown_option(key: &str) -> String {
    match REFUSED.iter().find(|(k, _)| *k == key) {
        Some((_, what)) => format!("`--{key}` ({what}) is not supported for samples"),
        None => format!(
            "`--{key}` is not an option of kohya's prompt lines (--n, --w, --h, --d, --s, --l, \
             --ss); a prompt cannot hold ` --`"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file is kohya's by its options, comments or A1111 weights; EveryDream2's plain lines
    /// and compel's `(words)1.3` are not.
    #[test]
    fn kohya_files_are_told_apart() {
        assert!(looks_like_kohya("a cat --n ugly\n"));
        assert!(looks_like_kohya("# samples\na cat\n"));
        assert!(looks_like_kohya("a (cat:1.2)\n"));
        assert!(!looks_like_kohya("a cat\na (dog)1.2, x--y\n"));
        assert!(!looks_like_kohya("12:30 at noon (cat)\n"));
    }

    /// kohya's example line reads as kohya's `line_to_prompt_dict` reads it. Catches an option
    /// applied to the wrong field, or the options left in the prompt.
    #[test]
    fn a_kohya_line_reads_its_options() {
        let p = parse_line(
            "masterpiece, a girl --n low quality, worst --W 768 --h 512 --d 1 --l 7.5 --s 28 --ss k_euler_a",
        )
        .unwrap();
        assert_eq!(p.prompt, PromptText::Text("masterpiece, a girl".into()));
        assert_eq!(p.negative_prompt, "low quality, worst");
        assert_eq!(p.size, SizeChoice::Exact(768, 512));
        assert_eq!(p.seed, Some(SeedChoice::Fixed(1)));
        assert_eq!(p.cfgs, Some(vec![7.5]));
        assert_eq!(p.steps, Some(28));
        assert_eq!(p.sampler, SamplerKind::parse("euler_a"));
        assert_eq!(parse_line("a cat --s 5000").unwrap().steps, Some(1000));
        assert_eq!(
            parse_line("a cat --h 640").unwrap().size,
            SizeChoice::Sides(None, Some(640))
        );
        let plain = parse_line("a cat, no options").unwrap();
        assert_eq!(plain.size, SizeChoice::Default);
        assert_eq!(plain.seed, None);
    }

    #[test]
    fn unknown_and_foreign_options_are_refused() {
        let err = parse_line("a cat --cn pose.png").unwrap_err();
        assert!(err.contains("ControlNet"), "{err}");
        let err = parse_line("a cat --x 1").unwrap_err();
        assert!(err.contains("`--x` is not an option"), "{err}");
        assert!(parse_line("a cat --w")
            .unwrap_err()
            .contains("needs a width"));
        assert!(parse_line("a cat --w 0").is_err());
        assert!(parse_line("a cat --l -1").is_err());
        let err = parse_line("a cat --ss heun").unwrap_err();
        assert!(err.contains("`heun` (kohya's)"), "{err}");
        assert!(parse_line("a cat --ss nonsense").is_err());
    }

    #[test]
    fn a_kohya_json_list_reads_lines_and_objects() {
        let items = serde_json::json!([
            "a cat --d 3",
            {"prompt": "a dog", "negative_prompt": "blur", "width": 512, "height": 768,
             "seed": 4, "sample_steps": 20, "scale": 5, "sample_sampler": "dpmsolver++"}
        ]);
        let ps = parse_list(items.as_array().unwrap()).unwrap();
        assert_eq!(ps[0].seed, Some(SeedChoice::Fixed(3)));
        assert_eq!(ps[1].size, SizeChoice::Exact(512, 768));
        assert_eq!(ps[1].cfgs, Some(vec![5.0]));
        assert_eq!(ps[1].sampler, SamplerKind::parse("dpm++_2m"));
        assert_eq!(ps[1].negative_prompt, "blur");
        let bad = serde_json::json!([{"prompt": "x", "controlnet_image": "a.png"}]);
        let err = parse_list(bad.as_array().unwrap()).unwrap_err();
        assert!(err.starts_with("entry 0 has `controlnet_image`"), "{err}");
    }

    /// Each `[[prompt.subset]]` reads over the `[prompt]` defaults, as kohya's
    /// `dict(**prompt, **subset)`. Catches the defaults dropped, a subset's own key lost to the
    /// default, or `subset` read as a key of each prompt.
    #[test]
    fn a_kohya_toml_reads_subsets_over_the_defaults() {
        let text = r#"
# kohya's .toml prompt file
[prompt]
negative_prompt = "blur"
width = 768
height = 512
scale = 5.5
sample_steps = 28

[[prompt.subset]]
prompt = "a (cat:1.2)"
seed = 3

[[prompt.subset]]
prompt = "a dog"
sample_sampler = "k_euler"
width = 640
"#;
        let ps = parse_toml(text).unwrap();
        assert_eq!(ps.len(), 2);
        assert_eq!(ps[0].prompt, PromptText::Text("a (cat:1.2)".into()));
        assert_eq!(ps[0].negative_prompt, "blur");
        assert_eq!(ps[0].size, SizeChoice::Exact(768, 512));
        assert_eq!(ps[0].cfgs, Some(vec![5.5]));
        assert_eq!(ps[0].steps, Some(28));
        assert_eq!(ps[0].seed, Some(SeedChoice::Fixed(3)));
        assert_eq!(ps[0].sampler, None);
        assert_eq!(ps[1].size, SizeChoice::Exact(640, 512));
        assert_eq!(ps[1].seed, None);
        assert_eq!(ps[1].negative_prompt, "blur");
        assert_eq!(ps[1].sampler, SamplerKind::parse("euler"));
    }

    #[test]
    fn a_bad_kohya_toml_is_refused_with_the_reason() {
        for (text, needle) in [
            ("[prompt\n", "is not valid TOML"),
            ("title = \"x\"\n[prompt]\n[[prompt.subset]]\nprompt = \"a\"\n", "has `title`"),
            ("prompt = 3\n", "`prompt`, which is not a table"),
            ("[other]\n", "has `other`"),
            ("[prompt]\nwidth = 512\n", "no `[[prompt.subset]]`"),
            ("[prompt]\nsubset = 3\n", "not a list of `[[prompt.subset]]` tables"),
            ("[prompt]\nsubset = [3]\n", "`prompt.subset` 0 is not a table"),
            (
                "[prompt]\n[[prompt.subset]]\nprompt = \"a\"\n[[prompt.subset]]\nprompt = \"b\"\nheight = 0\n",
                "`[[prompt.subset]]` 1 `height` must be positive",
            ),
            (
                "[prompt]\ncontrolnet_image = \"p.png\"\n[[prompt.subset]]\nprompt = \"a\"\n",
                "`[[prompt.subset]]` 0 has `controlnet_image`",
            ),
            (
                "[prompt]\n[[prompt.subset]]\nprompt = 1979-05-27\n",
                "`prompt` is not a string",
            ),
        ] {
            let err = parse_toml(text).unwrap_err();
            assert!(err.contains(needle), "{text:?}: {err}");
        }
        assert!(parse_toml("[prompt]\nsubset = []\n").unwrap().is_empty());
    }
}
