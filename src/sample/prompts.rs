//! EveryDream2's `sample_prompts` file: a `.txt` with one prompt per line, or a `.json` with
//! settings and a list of samples (`utils/sample_generator.py`):
//!
//! ```json
//! { "batch_size": 3, "seed": 555, "cfgs": [7, 4], "scheduler": "ddim",
//!   "num_inference_steps": 30, "generate_samples_every_n_steps": 200,
//!   "generate_pretrain_samples": true, "resolution": 512,
//!   "samples": [ { "prompt": "a cat", "negative_prompt": "blurry", "seed": -1,
//!                  "size": [640, 384] },
//!                { "random_caption": true, "aspect_ratio": 1.5 } ] }
//! ```
//!
//! Beyond EveryDream2, a sample may set its own `cfgs` (or one `cfg`), `steps` (or
//! `num_inference_steps`) and `scheduler`. Defaults are EveryDream2's: cfgs `[7, 4, 1.01]`,
//! 30 steps, `ddim`, the run's seed; a seed of −1 draws a new one each time. Blank lines of a
//! `.txt` are skipped. Unknown keys are errors naming the file.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::sampler::SamplerKind;
use super::{kohya_prompts, onetrainer_samples};

/// EveryDream2's `SampleGenerator` defaults.
pub const DEFAULT_CFGS: [f64; 3] = [7.0, 4.0, 1.01];
pub const DEFAULT_STEPS: usize = 30;

#[derive(Debug, thiserror::Error)]
pub enum PromptsError {
    #[error("cannot read the sample prompts file {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// What a sample's prompt is.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptText {
    Text(String),
    /// A caption of the training set (EveryDream2's `random_caption`).
    RandomCaption,
}

/// How a prompt's weights are written: compel's syntax (EveryDream2's samples: `word+`,
/// `(words)1.3`), or A1111's as kohya sd-scripts reads it (`(words:1.3)`, `[words]`, prompts
/// longer than 75 tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PromptSyntax {
    #[default]
    Compel,
    Kohya,
}

impl PromptText {
    /// The prompt's text; `None` for a random caption.
    pub fn text(&self) -> Option<&str> {
        match self {
            PromptText::Text(t) => Some(t),
            PromptText::RandomCaption => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SeedChoice {
    Fixed(u64),
    /// `-1`: a new seed each time samples are made.
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeChoice {
    /// The file's `resolution` (else the run's), square.
    Default,
    /// `size`: `[width, height]`.
    Exact(usize, usize),
    /// One side given (kohya's `--w` or `--h`), the other the resolution's.
    Sides(Option<usize>, Option<usize>),
    /// `aspect_ratio` (width/height): the nearest training bucket at the resolution.
    Aspect(f64),
}

/// One entry of `samples`.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplePrompt {
    pub prompt: PromptText,
    pub negative_prompt: String,
    pub seed: Option<SeedChoice>,
    pub size: SizeChoice,
    pub cfgs: Option<Vec<f64>>,
    pub steps: Option<usize>,
    pub sampler: Option<SamplerKind>,
    pub syntax: PromptSyntax,
}

/// A parsed sample prompts file.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleSet {
    pub path: PathBuf,
    pub prompts: Vec<SamplePrompt>,
    pub cfgs: Vec<f64>,
    pub steps: usize,
    pub sampler: SamplerKind,
    /// The file's default seed (else the run's).
    pub seed: Option<SeedChoice>,
    pub resolution: Option<usize>,
    /// `generate_samples_every_n_steps`, which wins over train.json's `sample_steps`.
    pub every_n_steps: Option<usize>,
    /// `generate_pretrain_samples`: samples before the first step too.
    pub at_start: bool,
    /// The file listed no prompts, and `prompts` holds EveryDream2's four random captions in
    /// their place (a run refuses a `.txt` without prompts, and says so for a `.json`).
    pub filled_in: bool,
}

impl SampleSet {
    pub fn read(path: &Path) -> Result<Self, PromptsError> {
        use crate::text_file::{read_unicode, TextFileError};
        let text = read_unicode(path).map_err(|e| match e {
            TextFileError::Io { path, source } => PromptsError::Read { path, source },
            TextFileError::Encoding { path, reason } => PromptsError::Invalid {
                path,
                message: reason,
            },
        })?;
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("txt") => Self::from_lines(path, &text),
            Some("json") => Self::from_json(path, &text),
            Some("toml") => Self::from_toml(path, &text),
            _ => Err(PromptsError::Invalid {
                path: path.to_path_buf(),
                message: "a sample prompts file must be a .txt (one prompt per line), a .json \
                          or a .toml (kohya's)"
                    .into(),
            }),
        }
    }

    fn defaults(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            prompts: Vec::new(),
            cfgs: DEFAULT_CFGS.to_vec(),
            steps: DEFAULT_STEPS,
            sampler: SamplerKind::Ddim,
            seed: None,
            resolution: None,
            every_n_steps: None,
            at_start: false,
            filled_in: false,
        }
    }

    /// One prompt per non-blank line, with kohya's options after ` --` and its `#` comments
    /// ([`super::kohya_prompts`]). A file with either, or with A1111's `(words:1.3)` weights, is
    /// kohya's, and its prompts are weighted as kohya weights them; otherwise as EveryDream2's.
    pub fn from_lines(path: &Path, text: &str) -> Result<Self, PromptsError> {
        let mut set = Self::defaults(path);
        let syntax = match kohya_prompts::looks_like_kohya(text) {
            true => PromptSyntax::Kohya,
            false => PromptSyntax::Compel,
        };
        set.prompts = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !kohya_prompts::is_comment(l))
            .map(|(i, l)| {
                kohya_prompts::parse_line(l)
                    .map(|p| SamplePrompt { syntax, ..p })
                    .and_then(|p| p.check_weighting().map(|()| p))
                    .map_err(|message| PromptsError::Invalid {
                        path: path.to_path_buf(),
                        message: format!("line {}: {message}", i + 1),
                    })
            })
            .collect::<Result<_, _>>()?;
        set.fill_empty();
        Ok(set)
    }

    /// EveryDream2 samples random captions when the file lists none.
    fn fill_empty(&mut self) {
        if self.prompts.is_empty() {
            self.prompts = (0..4)
                .map(|_| SamplePrompt::plain(PromptText::RandomCaption))
                .collect();
            self.filled_in = true;
        }
    }

    /// kohya's `.toml` prompt files ([`kohya_prompts::parse_toml`]), weighted as kohya's.
    pub fn from_toml(path: &Path, text: &str) -> Result<Self, PromptsError> {
        Self::kohyas(path, kohya_prompts::parse_toml(text), "`[[prompt.subset]]`")
    }

    /// The set of a kohya file's `prompts` (or its error), read in A1111's weighting; `entry`
    /// names one prompt of the file in errors.
    fn kohyas(
        path: &Path,
        prompts: Result<Vec<SamplePrompt>, String>,
        entry: &str,
    ) -> Result<Self, PromptsError> {
        let bad = |message: String| PromptsError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let mut set = Self::defaults(path);
        set.prompts = prompts.map_err(bad)?;
        for (i, p) in set.prompts.iter_mut().enumerate() {
            p.syntax = PromptSyntax::Kohya;
            p.check_weighting()
                .map_err(|m| bad(format!("{entry} {i}: {m}")))?;
        }
        set.fill_empty();
        Ok(set)
    }

    /// OneTrainer's samples: each its own size, seed, steps, scale and scheduler, read in
    /// A1111's weighting as kohya's are; a file whose samples are all disabled is refused.
    fn onetrainers(
        path: &Path,
        prompts: Result<Vec<SamplePrompt>, String>,
    ) -> Result<Self, PromptsError> {
        if matches!(&prompts, Ok(p) if p.is_empty()) {
            return Err(PromptsError::Invalid {
                path: path.to_path_buf(),
                message: "holds no enabled OneTrainer sample".into(),
            });
        }
        Self::kohyas(path, prompts, "sample")
    }

    pub fn from_json(path: &Path, text: &str) -> Result<Self, PromptsError> {
        let bad = |message: String| PromptsError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let root: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("is not valid JSON: {e}")))?;
        if let Some(items) = root.as_array() {
            if onetrainer_samples::is_onetrainer_list(items) {
                return Self::onetrainers(path, onetrainer_samples::parse_list(items));
            }
            return Self::kohyas(path, kohya_prompts::parse_list(items), "entry");
        }
        let obj = root.as_object().ok_or_else(|| {
            bad("must hold a JSON object (EveryDream2's) or a list (kohya's)".into())
        })?;
        if onetrainer_samples::is_onetrainer_config(obj) {
            let items = match obj.get("samples") {
                Some(Value::Array(items)) => items.as_slice(),
                _ => &[],
            };
            return Self::onetrainers(path, onetrainer_samples::parse_list(items));
        }
        let top = Fields::new(obj, "", path);
        top.only(&[
            "batch_size",
            "seed",
            "cfgs",
            "scheduler",
            "num_inference_steps",
            "show_progress_bars",
            "generate_samples_every_n_steps",
            "generate_pretrain_samples",
            "resolution",
            "samples",
        ])?;
        let mut set = Self::defaults(path);
        if let Some(c) = top.cfgs("cfgs")? {
            set.cfgs = c;
        }
        if let Some(s) = top.count("num_inference_steps")? {
            set.steps = s;
        }
        if let Some(s) = top.sampler("scheduler")? {
            set.sampler = s;
        }
        set.seed = top.seed("seed")?;
        set.resolution = top.count("resolution")?;
        set.every_n_steps = top.count("generate_samples_every_n_steps")?;
        set.at_start = top.flag("generate_pretrain_samples")?.unwrap_or(false);
        // Accepted for EveryDream2 files; samples are drawn one prompt at a time here.
        top.count("batch_size")?;
        top.flag("show_progress_bars")?;
        if let Some(list) = obj.get("samples").filter(|v| !v.is_null()) {
            let list = list
                .as_array()
                .ok_or_else(|| bad("`samples` must be a list of objects".into()))?;
            for (i, entry) in list.iter().enumerate() {
                let where_ = format!("samples[{i}].");
                let o = entry
                    .as_object()
                    .ok_or_else(|| bad(format!("`samples[{i}]` must be an object")))?;
                let p = SamplePrompt::from_json(Fields::new(o, &where_, path))?;
                p.check_weighting()
                    .map_err(|m| bad(format!("`samples[{i}]`: {m}")))?;
                set.prompts.push(p);
            }
        }
        set.fill_empty();
        Ok(set)
    }
}

impl SamplePrompt {
    /// The prompt and negative prompt read in their weighting syntax: compel's
    /// ([`super::compel_syntax`]), as EveryDream2's samples read them, or A1111's for a kohya
    /// file ([`super::a1111_syntax`]).
    pub fn check_weighting(&self) -> Result<(), String> {
        let texts = [
            ("prompt", self.prompt.text()),
            ("negative prompt", Some(self.negative_prompt.as_str())),
        ];
        for (what, text) in texts {
            if let Some(t) = text {
                check_syntax(self.syntax, t).map_err(|e| format!("{what} `{t}`: {e}"))?;
            }
        }
        Ok(())
    }

    /// `prompt` with every setting left to the file's or the run's.
    pub(super) fn plain(prompt: PromptText) -> Self {
        Self {
            prompt,
            negative_prompt: String::new(),
            seed: None,
            size: SizeChoice::Default,
            cfgs: None,
            steps: None,
            sampler: None,
            syntax: PromptSyntax::Compel,
        }
    }

    fn from_json(f: Fields<'_>) -> Result<Self, PromptsError> {
        f.only(&[
            "prompt",
            "negative_prompt",
            "seed",
            "size",
            "aspect_ratio",
            "random_caption",
            "cfgs",
            "cfg",
            "steps",
            "num_inference_steps",
            "scheduler",
        ])?;
        let random = f.flag("random_caption")?.unwrap_or(false);
        let text = f.string("prompt")?.unwrap_or_default();
        let prompt = if random {
            PromptText::RandomCaption
        } else {
            PromptText::Text(text)
        };
        let size = match (f.get("size"), f.number("aspect_ratio")?) {
            (Some(v), _) => {
                let wh = v
                    .as_array()
                    .filter(|a| a.len() == 2)
                    .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
                    .filter(|&(w, h)| w > 0 && h > 0)
                    .ok_or_else(|| f.bad("size", "must be [width, height] in pixels"))?;
                SizeChoice::Exact(wh.0 as usize, wh.1 as usize)
            }
            (None, Some(r)) if r.is_finite() && r > 0.0 => SizeChoice::Aspect(r),
            (None, Some(_)) => return Err(f.bad("aspect_ratio", "must be a positive number")),
            (None, None) => SizeChoice::Default,
        };
        let cfgs = match (f.cfgs("cfgs")?, f.number("cfg")?) {
            (Some(_), Some(_)) => return Err(f.bad("cfg", "and `cfgs` are both set")),
            (Some(c), None) => Some(c),
            (None, Some(c)) => Some(check_cfgs(&f, "cfg", vec![c])?),
            (None, None) => None,
        };
        let steps = match (f.count("steps")?, f.count("num_inference_steps")?) {
            (Some(_), Some(_)) => {
                return Err(f.bad("steps", "and `num_inference_steps` are both set"))
            }
            (a, b) => a.or(b),
        };
        Ok(Self {
            prompt,
            negative_prompt: f.string("negative_prompt")?.unwrap_or_default(),
            seed: f.seed("seed")?,
            size,
            cfgs,
            steps,
            sampler: f.sampler("scheduler")?,
            syntax: PromptSyntax::Compel,
        })
    }
}

/// Whether `text` reads in `syntax`: the reason when not.
pub fn check_syntax(syntax: PromptSyntax, text: &str) -> Result<(), String> {
    match syntax {
        PromptSyntax::Compel => super::compel_syntax::parse(text).map(drop),
        PromptSyntax::Kohya => super::a1111_syntax::parse(text).map(drop),
    }
}

fn check_cfgs(f: &Fields<'_>, key: &str, cfgs: Vec<f64>) -> Result<Vec<f64>, PromptsError> {
    if cfgs.is_empty() || cfgs.iter().any(|c| !c.is_finite() || *c < 0.0) {
        return Err(f.bad(key, "must hold guidance scales ≥ 0"));
    }
    Ok(cfgs)
}

/// Typed access to one JSON object's fields, with errors naming the file and the key.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn new(obj: &'a Map<String, Value>, prefix: &'a str, path: &'a Path) -> Self {
        Self { obj, prefix, path }
    }

    fn bad(&self, key: &str, problem: &str) -> PromptsError {
        PromptsError::Invalid {
            path: self.path.to_path_buf(),
            message: format!("`{}{key}` {problem}", self.prefix),
        }
    }

    fn only(&self, known: &[&str]) -> Result<(), PromptsError> {
        match self.obj.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(self.bad(
                k,
                &format!("is not a sample setting ({})", known.join(", ")),
            )),
            None => Ok(()),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn number(&self, key: &str) -> Result<Option<f64>, PromptsError> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.bad(key, "must be a number")))
            .transpose()
    }

    fn count(&self, key: &str) -> Result<Option<usize>, PromptsError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .filter(|&n| n >= 1)
                    .map(|n| n as usize)
                    .ok_or_else(|| self.bad(key, "must be a whole number ≥ 1"))
            })
            .transpose()
    }

    fn flag(&self, key: &str) -> Result<Option<bool>, PromptsError> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.bad(key, "must be true or false"))
            })
            .transpose()
    }

    fn string(&self, key: &str) -> Result<Option<String>, PromptsError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.bad(key, "must be a string"))
            })
            .transpose()
    }

    fn seed(&self, key: &str) -> Result<Option<SeedChoice>, PromptsError> {
        self.get(key)
            .map(|v| match (v.as_i64(), v.as_u64()) {
                (Some(-1), _) => Ok(SeedChoice::Random),
                (_, Some(n)) => Ok(SeedChoice::Fixed(n)),
                _ => Err(self.bad(key, "must be a whole number ≥ 0, or -1 for a random seed")),
            })
            .transpose()
    }

    fn cfgs(&self, key: &str) -> Result<Option<Vec<f64>>, PromptsError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let list = v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
            .ok_or_else(|| self.bad(key, "must be a list of numbers"))?;
        check_cfgs(self, key, list).map(Some)
    }

    fn sampler(&self, key: &str) -> Result<Option<SamplerKind>, PromptsError> {
        self.string(key)?
            .map(|s| SamplerKind::parse(&s).ok_or_else(|| self.bad(key, &SamplerKind::unknown(&s))))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(text: &str) -> Result<SampleSet, PromptsError> {
        SampleSet::from_json(Path::new("s.json"), text)
    }

    #[test]
    fn txt_lines_are_prompts_with_everydream2_defaults() {
        let s = SampleSet::from_lines(Path::new("p.txt"), "a cat\n\n  a dog  \n").unwrap();
        assert_eq!(s.prompts.len(), 2);
        assert_eq!(s.prompts[1].prompt, PromptText::Text("a dog".into()));
        assert_eq!(s.cfgs, DEFAULT_CFGS);
        assert_eq!((s.steps, s.sampler), (30, SamplerKind::Ddim));
        let empty = SampleSet::from_lines(Path::new("p.txt"), "\n").unwrap();
        assert_eq!(empty.prompts.len(), 4);
        assert!(empty
            .prompts
            .iter()
            .all(|p| p.prompt == PromptText::RandomCaption));
    }

    #[test]
    fn json_reads_everydream2_settings_and_per_sample_overrides() {
        let s = json(
            r#"{"batch_size": 3, "seed": 555, "cfgs": [7, 4], "scheduler": "euler_a",
                "num_inference_steps": 15, "show_progress_bars": true,
                "generate_samples_every_n_steps": 200, "generate_pretrain_samples": true,
                "samples": [
                  {"prompt": "a cat", "negative_prompt": "blurry", "seed": -1, "size": [640, 384]},
                  {"random_caption": true, "aspect_ratio": 1.5, "cfg": 3, "steps": 9,
                   "scheduler": "ddim"}]}"#,
        )
        .unwrap();
        assert_eq!(s.cfgs, [7.0, 4.0]);
        assert_eq!((s.steps, s.sampler), (15, SamplerKind::EulerAncestral));
        assert_eq!(s.seed, Some(SeedChoice::Fixed(555)));
        assert_eq!((s.every_n_steps, s.at_start), (Some(200), true));
        let (a, b) = (&s.prompts[0], &s.prompts[1]);
        assert_eq!(a.negative_prompt, "blurry");
        assert_eq!(a.seed, Some(SeedChoice::Random));
        assert_eq!(a.size, SizeChoice::Exact(640, 384));
        assert_eq!(b.prompt, PromptText::RandomCaption);
        assert_eq!(b.size, SizeChoice::Aspect(1.5));
        assert_eq!(b.cfgs, Some(vec![3.0]));
        assert_eq!((b.steps, b.sampler), (Some(9), Some(SamplerKind::Ddim)));
    }

    #[test]
    fn json_errors_name_the_key() {
        for (text, needle) in [
            (r#"{"cfgs": 7}"#, "`cfgs` must be a list"),
            (
                r#"{"scheduler": "heun"}"#,
                "`scheduler` is \"heun\"; the samplers are",
            ),
            (
                r#"{"samples": [{"promt": "x"}]}"#,
                "`samples[0].promt` is not a sample setting",
            ),
            (
                r#"{"samples": [{"size": [64]}]}"#,
                "`samples[0].size` must be",
            ),
            (r#"{"samples": [{"seed": -2}]}"#, "`samples[0].seed`"),
            (
                r#"{"num_inference_steps": 0}"#,
                "`num_inference_steps` must be",
            ),
            ("[1]", "entry 0 is neither a prompt line nor an object"),
            (
                "7",
                "must hold a JSON object (EveryDream2's) or a list (kohya's)",
            ),
        ] {
            let e = json(text).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("s.json"), "{text}: {e}");
        }
    }
}
