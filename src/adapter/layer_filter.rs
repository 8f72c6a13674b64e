//! OneTrainer's layer filter (`layer_filter`, `layer_filter_regex`: modules/util/ModuleFilter.py,
//! commit 23df3832): which of the UNet's layers get adapters, by their diffusers module path
//! (`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`). A layer is adapted when any
//! pattern matches it: as a substring, or with `regex` as a regular expression found anywhere in
//! the path (Python's `re.search`; look-around is supported). Patterns are trimmed, and an empty
//! one matches every layer, as in OneTrainer.
//!
//! The filter narrows the adapter mode's own targets (kohya's): it picks among the layers the
//! mode adapts and never adds one (conv_in, conv_out and the time embedding stay without
//! adapters). A pattern that matches none of them is an error, as OneTrainer raises one for a
//! filter that matches no module.

use serde::Serialize;

/// One pattern of the filter.
#[derive(Debug, Clone)]
enum Pattern {
    Substring(String),
    Regex(Box<fancy_regex::Regex>),
}

/// The UNet layer filter (module docs).
#[derive(Debug, Clone, Serialize)]
pub struct LayerFilter {
    /// The patterns as written (trimmed).
    pub patterns: Vec<String>,
    pub regex: bool,
    #[serde(skip)]
    compiled: Vec<Pattern>,
}

impl PartialEq for LayerFilter {
    fn eq(&self, other: &Self) -> bool {
        self.patterns == other.patterns && self.regex == other.regex
    }
}

impl LayerFilter {
    /// The filter of these patterns; the error names a regular expression that does not compile.
    pub fn new(patterns: &[String], regex: bool) -> Result<Self, String> {
        let patterns: Vec<String> = patterns.iter().map(|p| p.trim().to_string()).collect();
        let compiled = patterns
            .iter()
            .map(|p| {
                if regex && !p.is_empty() {
                    fancy_regex::Regex::new(p)
                        .map(|r| Pattern::Regex(Box::new(r)))
                        .map_err(|e| format!("the regular expression {p:?} does not compile: {e}"))
                } else {
                    Ok(Pattern::Substring(p.clone()))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            patterns,
            regex,
            compiled,
        })
    }

    /// OneTrainer's comma-separated form (`"attn1, attn2"`).
    pub fn from_comma_list(list: &str, regex: bool) -> Result<Self, String> {
        let parts: Vec<String> = list.split(',').map(str::to_string).collect();
        Self::new(&parts, regex)
    }

    /// Whether pattern `i` matches `path`.
    fn pattern_matches(&self, i: usize, path: &str) -> bool {
        match &self.compiled[i] {
            Pattern::Substring(s) => path.contains(s.as_str()),
            // A match that runs out of backtracking budget counts as no match.
            Pattern::Regex(r) => r.is_match(path).unwrap_or(false),
        }
    }

    /// Whether any pattern matches the layer at `path`.
    pub fn matches(&self, path: &str) -> bool {
        (0..self.compiled.len()).any(|i| self.pattern_matches(i, path))
    }

    /// The patterns that match none of `paths`.
    pub fn unmatched<'a>(&self, paths: impl IntoIterator<Item = &'a str> + Clone) -> Vec<String> {
        (0..self.compiled.len())
            .filter(|&i| {
                !paths
                    .clone()
                    .into_iter()
                    .any(|p| self.pattern_matches(i, p))
            })
            .map(|i| self.patterns[i].clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(list: &str, regex: bool) -> LayerFilter {
        LayerFilter::from_comma_list(list, regex).unwrap()
    }

    /// OneTrainer's own examples (ModuleFilter.py's tests): substrings, trimmed, any of them.
    #[test]
    fn substrings_match_as_onetrainers_do() {
        let f = filter("attentions, conv1, time_emb", false);
        assert!(f.matches("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_v"));
        assert!(f.matches("down_blocks.1.resnets.0.conv1"));
        assert!(f.matches("mid_block.resnets.0.time_emb_proj"));
        assert!(!f.matches("down_blocks.1.resnets.0.conv2"));
        assert!(!f.matches("up_blocks.2.resnets.1.conv_shortcut"));
        assert!(filter("", false).matches("anything"));
    }

    #[test]
    fn regexes_search_anywhere_and_look_ahead() {
        let f = filter(r"attn[12]\.to_[qk]$", true);
        assert!(f.matches("mid_block.attentions.0.transformer_blocks.0.attn2.to_k"));
        assert!(!f.matches("mid_block.attentions.0.transformer_blocks.0.attn2.to_v"));
        let f = filter(r"^(?!up_blocks).*attn1", true);
        assert!(f.matches("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"));
        assert!(!f.matches("up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"));
        let err = LayerFilter::from_comma_list("attn(", true).unwrap_err();
        assert!(err.contains("attn("), "{err}");
        // Without `regex` the same text is a plain substring.
        assert!(filter("attn(", false).matches("x.attn(.y"));
    }

    #[test]
    fn unmatched_patterns_are_named() {
        let f = filter("attn1, atn2", false);
        let paths = ["a.attn1.to_q", "a.attn2.to_q"];
        assert_eq!(f.unmatched(paths.iter().copied()), vec!["atn2".to_string()]);
    }
}
