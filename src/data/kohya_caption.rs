//! kohya sd-scripts' caption keys beyond the shuffle (`BaseDataset.process_caption` in
//! `library/train_util.py`), in kohya's order after the caption dropout:
//!
//! 1. `enable_wildcard`: a caption of several lines trains one of them, drawn each time (the
//!    caption file's non-empty lines, as kohya's `read_caption` reads them with wildcards on),
//!    and each `{a|b|c}` becomes one of its choices (`{{` and `}}` are literal braces). Without
//!    it, a caption's first line is used.
//! 2. With the shuffle or tag dropout on, `keep_tokens_separator` splits the caption in up to
//!    three parts, `fixed ||| flex ||| fixed suffix`: only the middle part's tags are shuffled
//!    and dropped, and the caption is `fixed, flex…, suffix` (every tag trimmed, empty ones
//!    gone). A caption without the separator is shuffled as without the key. As in kohya, the
//!    separator stays in a caption that is neither shuffled nor tag-dropped.
//! 3. `secondary_separator`: replaced by `,` at the very end, so tags it joins move and drop
//!    together (`a;;;b` becomes `a,b`, kohya's `caption_separator`).
//!
//! Two keys depend on where the run is: `caption_dropout_every_n_epochs` drops every caption in
//! epochs `n`, `2n`, … (kohya counts epochs from 1), and `token_warmup_min`/`token_warmup_step`
//! train only the first `min` tags after the kept ones at first, one more every
//! `step/(tags − min)` steps until step `token_warmup_step` (a fraction of the run below 1); while
//! it is set, captions are split and rejoined as in step 2 even after the warmup.

use rand::Rng;
use serde::Serialize;

/// kohya's `caption_separator`, which the secondary separator becomes.
pub const CAPTION_SEPARATOR: &str = ",";

/// The keys as resolved.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KohyaCaptions {
    pub keep_tokens_separator: Option<String>,
    pub secondary_separator: Option<String>,
    /// `enable_wildcard`.
    pub wildcard: bool,
    /// OneTrainer's captions: a caption of several lines trains one of them, drawn each time
    /// (no `{…|…}` groups, unlike `wildcard`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub random_line: bool,
    /// `caption_dropout_every_n_epochs` (0: off).
    pub dropout_every_n_epochs: usize,
    /// `token_warmup_min` and `token_warmup_step`, when the step is above 0.
    pub token_warmup: Option<TokenWarmup>,
}

/// The caption settings of one subset of a kohya dataset config (`[[datasets.subsets]]`,
/// `crate::data::kohya_subsets`), which its images train with instead of train.json's:
/// kohya's `process_caption` as it is. Unlike train.json's `keep_tags` (which counts after the
/// main prompt, always kept), `keep_tokens` counts from the first piece, so 0 shuffles every
/// piece; pieces are split on `separator` (kohya's `caption_separator`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubsetCaptions {
    /// `shuffle_caption`.
    pub shuffle: bool,
    pub keep_tokens: usize,
    /// `caption_separator` (kohya's default `,`).
    pub separator: String,
    /// `caption_tag_dropout_rate`.
    pub tag_dropout: f64,
    /// How the tag dropout draws (kohya's: each tag on its own).
    #[serde(skip_serializing_if = "TagDropoutMode::is_per_tag")]
    pub tag_dropout_mode: TagDropoutMode,
    pub keys: KohyaCaptions,
}

/// How tags are dropped: kohya's per tag, or OneTrainer's other modes (its `DropTags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TagDropoutMode {
    /// Each tag with the rate, on its own (kohya's `caption_tag_dropout_rate`, OneTrainer's
    /// RANDOM).
    #[default]
    PerTag,
    /// OneTrainer's FULL: one draw per caption, which drops every droppable tag.
    Whole,
    /// OneTrainer's RANDOM WEIGHTED: tag i of n (0-based, before the shuffle) with the rate
    /// times `(i + 1)/n`.
    Weighted,
}

impl TagDropoutMode {
    fn is_per_tag(&self) -> bool {
        *self == TagDropoutMode::PerTag
    }

    /// The droppable `tags` after the dropout, drawing from `rng`.
    pub fn drop_tags(self, tags: &mut Vec<String>, rate: f64, rng: &mut impl Rng) {
        match self {
            TagDropoutMode::PerTag => tags.retain(|_| rng.random::<f64>() >= rate),
            TagDropoutMode::Whole => {
                if rng.random::<f64>() < rate {
                    tags.clear();
                }
            }
            TagDropoutMode::Weighted => {
                let n = tags.len() as f64;
                let mut i = 0.0;
                tags.retain(|_| {
                    i += 1.0;
                    rng.random::<f64>() >= rate * i / n
                });
            }
        }
    }
}

impl SubsetCaptions {
    /// Whether a caption can change from step to step (so the text cache cannot hold it).
    pub fn per_step(&self) -> bool {
        self.shuffle
            || self.tag_dropout > 0.0
            || self.keys.wildcard
            || self.keys.random_line
            || self.keys.token_warmup.is_some()
    }
}

/// kohya's token warmup.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokenWarmup {
    pub min: usize,
    /// Steps, or below 1 a fraction of the run's steps.
    pub steps: f64,
}

impl KohyaCaptions {
    /// Whether a key is set.
    pub fn any(&self) -> bool {
        self.keep_tokens_separator.is_some()
            || self.secondary_separator.is_some()
            || self.wildcard
            || self.dropout_every_n_epochs > 0
            || self.token_warmup.is_some()
    }

    /// Whether every caption of epoch `epoch` (from 0) is dropped.
    pub fn drops_epoch(&self, epoch: usize) -> bool {
        self.dropout_every_n_epochs > 0 && (epoch + 1).is_multiple_of(self.dropout_every_n_epochs)
    }
}

impl TokenWarmup {
    /// How many of `flex` tags train at step `step` (from 0) of a run of `total` steps, or `None`
    /// once the warmup is over (kohya: `floor(step · (tags − min) / warmup) + min`, taken as
    /// Python slices it).
    pub fn tags_at(&self, flex: usize, step: usize, total: usize) -> Option<usize> {
        let warmup = match self.steps < 1.0 {
            true => (self.steps * total as f64).floor() as usize,
            false => self.steps as usize,
        };
        if warmup == 0 || step >= warmup {
            return None;
        }
        let share = (flex as f64 - self.min as f64) / warmup as f64;
        let n = (step as f64 * share).floor() as i64 + self.min as i64;
        Some(match n {
            n if n >= 0 => (n as usize).min(flex),
            n => (flex as i64 + n).max(0) as usize,
        })
    }
}

/// Step 1 with wildcards on: one of the caption's lines, then each `{…|…}` replaced by one of its
/// choices, every choice drawn from `rng` (one draw per multi-line caption and per group).
pub fn expand_wildcards(caption: &str, rng: &mut impl Rng) -> String {
    let lines: Vec<&str> = caption.split('\n').collect();
    let line = match lines.len() {
        1 => caption,
        n => lines[rng.random_range(0..n)],
    };
    // `{{` and `}}` are literal braces, kept out of the groups.
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("{{") {
            out.push('{');
            rest = r;
        } else if let Some(r) = rest.strip_prefix("}}") {
            out.push('}');
            rest = r;
        } else if let Some(group) = rest.strip_prefix('{').and_then(|r| group_of(r)) {
            let choices: Vec<&str> = group.split('|').collect();
            out.push_str(choices[rng.random_range(0..choices.len())]);
            rest = &rest[group.len() + 2..];
        } else {
            let c = rest.chars().next().unwrap_or_default();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The text of a group opened just before `after` (kohya's regex `\{([^}]+)\}`: up to the first
/// `}`, not empty, and not crossing an escaped `{{`/`}}`).
fn group_of(after: &str) -> Option<&str> {
    let end = after.find('}')?;
    let body = &after[..end];
    let escaped = after[end..].starts_with("}}") || body.contains("{{");
    (end > 0 && !escaped).then_some(body)
}

#[cfg(test)]
mod dropout_tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    /// FULL drops all or nothing, RANDOM WEIGHTED drops later tags more often (OneTrainer's
    /// `p·(i+1)/n`), per tag drops each alike. Catches the modes swapped or the weight reversed.
    #[test]
    fn dropout_modes_draw_as_onetrainer() {
        let tags: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
        let mut rng = StdRng::seed_from_u64(3);
        let (mut whole_kept, mut counts) = (Vec::new(), [0usize; 4]);
        for _ in 0..4000 {
            let mut t = tags.clone();
            TagDropoutMode::Whole.drop_tags(&mut t, 0.5, &mut rng);
            whole_kept.push(t.len());
            let mut w = tags.clone();
            TagDropoutMode::Weighted.drop_tags(&mut w, 0.8, &mut rng);
            for (i, tag) in tags.iter().enumerate() {
                counts[i] += usize::from(w.contains(tag));
            }
        }
        assert!(whole_kept.iter().all(|&k| k == 0 || k == 4));
        let dropped = whole_kept.iter().filter(|&&k| k == 0).count() as f64 / 4000.0;
        assert!((dropped - 0.5).abs() < 0.03, "{dropped}");
        // Kept with 1 − 0.8·(i+1)/4: 0.8, 0.6, 0.4, 0.2.
        for (i, &c) in counts.iter().enumerate() {
            let want = 1.0 - 0.8 * (i as f64 + 1.0) / 4.0;
            assert!((c as f64 / 4000.0 - want).abs() < 0.03, "tag {i}: {c}");
        }
    }
}

/// OneTrainer's step: one of the caption's lines, drawn from `rng`.
pub fn random_line(caption: &str, rng: &mut impl Rng) -> String {
    let lines: Vec<&str> = caption.split('\n').collect();
    lines[rng.random_range(0..lines.len())].to_string()
}

/// Step 1 with wildcards off: the first line.
pub fn first_line(caption: &str) -> &str {
    caption.split('\n').next().unwrap_or_default()
}

/// Step 2's split: `(fixed, flex, fixed suffix)` tags, trimmed and without empty ones, or `None`
/// when the caption does not hold the separator.
pub fn split_kept(
    caption: &str,
    separator: &str,
) -> Option<(Vec<String>, Vec<String>, Vec<String>)> {
    split_kept_on(caption, separator, CAPTION_SEPARATOR)
}

/// [`split_kept`] with the tags split on `caption_separator` (a dataset config subset's).
pub fn split_kept_on(
    caption: &str,
    separator: &str,
    caption_separator: &str,
) -> Option<(Vec<String>, Vec<String>, Vec<String>)> {
    if separator.is_empty() {
        return None;
    }
    let tags = |s: &str| -> Vec<String> {
        s.split(caption_separator)
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect()
    };
    let (fixed, flex) = caption.split_once(separator)?;
    let (flex, suffix) = match flex.split_once(separator) {
        Some((flex, suffix)) => (flex, tags(suffix)),
        None => (flex, Vec::new()),
    };
    Some((tags(fixed), tags(flex), suffix))
}

/// Step 3.
pub fn replace_secondary(caption: &str, separator: Option<&str>) -> String {
    replace_secondary_with(caption, separator, CAPTION_SEPARATOR)
}

/// Step 3 for a dataset config subset: the secondary separator becomes its
/// `caption_separator`.
pub fn replace_secondary_with(caption: &str, separator: Option<&str>, with: &str) -> String {
    match separator.filter(|s| !s.is_empty()) {
        Some(s) => caption.replace(s, with),
        None => caption.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;

    #[test]
    fn wildcards_pick_a_line_and_a_choice_and_keep_escaped_braces() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(expand_wildcards("a {red|blue} cat\nsecond", &mut rng));
        }
        let want: std::collections::BTreeSet<String> = ["a red cat", "a blue cat", "second"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(seen, want);
        assert_eq!(expand_wildcards("{{literal}} {x}", &mut rng), "{literal} x");
        assert_eq!(expand_wildcards("no groups {}", &mut rng), "no groups {}");
        assert_eq!(expand_wildcards("é {ü|ü}", &mut rng), "é ü");
        assert_eq!(first_line("one\ntwo"), "one");
    }

    #[test]
    fn the_keep_separator_splits_in_three_and_the_secondary_one_joins() {
        let (fixed, flex, suffix) = split_kept("1girl, solo ||| a, , b ||| end, x", "|||").unwrap();
        assert_eq!(fixed, ["1girl", "solo"]);
        assert_eq!(flex, ["a", "b"]);
        assert_eq!(suffix, ["end", "x"]);
        let (fixed, flex, suffix) = split_kept("a |||b, c", "|||").unwrap();
        assert_eq!(
            (fixed, flex),
            (vec!["a".to_string()], vec!["b".into(), "c".into()])
        );
        assert!(suffix.is_empty());
        assert!(split_kept("a, b", "|||").is_none());
        assert_eq!(replace_secondary("a;;;b, c", Some(";;;")), "a,b, c");
        assert_eq!(replace_secondary("a;;;b", None), "a;;;b");
    }

    #[test]
    fn token_warmup_grows_the_tags_and_epochs_drop_by_kohyas_count() {
        let w = TokenWarmup {
            min: 1,
            steps: 10.0,
        };
        let at: Vec<Option<usize>> = (0..12).map(|s| w.tags_at(5, s, 100)).collect();
        assert_eq!(at[0], Some(1));
        assert_eq!(at[3], Some(2)); // floor(3·4/10) + 1
        assert_eq!(at[9], Some(4));
        assert_eq!((at[10], at[11]), (None, None));
        let frac = TokenWarmup { min: 2, steps: 0.5 };
        assert_eq!(frac.tags_at(6, 0, 20), Some(2));
        assert_eq!(frac.tags_at(6, 10, 20), None, "half of 20 steps");
        let k = KohyaCaptions {
            dropout_every_n_epochs: 3,
            ..Default::default()
        };
        let dropped: Vec<usize> = (0..9).filter(|&e| k.drops_epoch(e)).collect();
        assert_eq!(dropped, [2, 5, 8], "kohya's epochs 3, 6, 9");
    }
}
