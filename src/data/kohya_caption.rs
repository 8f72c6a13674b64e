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
}

impl KohyaCaptions {
    /// Whether a key is set.
    pub fn any(&self) -> bool {
        self.keep_tokens_separator.is_some() || self.secondary_separator.is_some() || self.wildcard
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
    let tags = |s: &str| -> Vec<String> {
        s.split(CAPTION_SEPARATOR)
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
    match separator {
        Some(s) => caption.replace(s, CAPTION_SEPARATOR),
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
}
