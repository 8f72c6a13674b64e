//! An image's settings as training uses them ([`ItemOptions`]), and the caption shuffles of
//! EveryDream2's `ImageCaption` (`data/image_train_item.py`):
//!
//! - unweighted ([`shuffled_tags`], `__get_shuffled_tags`): the first `keep_tags` tags stay in
//!   place, the rest are shuffled with `random.Random(seed).shuffle`;
//! - weighted ([`weighted_tags`], `__get_weighted_shuffled_tags`, used when an image's tags do not
//!   all have the same weight): tags are drawn one at a time without replacement, each with
//!   probability proportional to its weight (`uniform(0, Σw)` located with `bisect_left` in the
//!   cumulative weights), until none is left or the caption reaches `max_caption_length` minus
//!   the main prompt's length. As in EveryDream2's code, the length is checked before a tag is
//!   added, so the tag that crosses the limit is kept (SHUFFLING_TAGS.md says it is not);
//!   `keep_tags` does not apply.
//!
//! The caption is `main prompt, tag, tag…`. Each shuffle uses [`PyRandom`] seeded per sample
//! from the step's generator; EveryDream2 seeds it with the epoch's seed, so every caption with
//! the same tag count gets the same permutation within an epoch.
//!
//! Deliberate difference: `keep_tags` keeps the first N tags as EveryDream2's argparser help and
//! SHUFFLING_TAGS.md describe it. EveryDream2's code computes `min(keep_tags, 0)`, which is 0 for
//! every positive N, so there `keep_tags` never keeps anything.

use std::sync::Arc;

use super::kohya_caption::SubsetCaptions;
use super::py_random::PyRandom;

/// What one image brings besides its pixels: its caption's parts and its own settings, from its
/// files ([`super::image_config`]). Unset settings fall back to train.json's.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOptions {
    /// EveryDream2's rating for `rated_dataset` (1 unless a YAML file sets it).
    pub rating: f64,
    pub flip_p: Option<f64>,
    pub cond_dropout: Option<f64>,
    /// Shuffle this image's tags even when train.json's `shuffle_tags` is off.
    pub shuffle_tags: bool,
    /// The main prompt and the tags, in caption order (by weight, highest first). Both empty:
    /// split the caption text on commas instead.
    pub main: String,
    pub tags: Vec<String>,
    /// The tags' weights, when they are not all equal (then the shuffle is weighted).
    pub tag_weights: Option<Vec<f64>>,
    pub max_caption_length: usize,
    /// `Some(w)` for a regularization image (`reg_data_root`): its loss is weighed by `w`
    /// (kohya's `prior_loss_weight`, [`super::regularization`]).
    pub prior_loss_weight: Option<f64>,
    /// The caption settings of the kohya dataset-config subset the image comes from, which
    /// replace train.json's caption keys for it (`crate::data::kohya_subsets`).
    pub subset_captions: Option<Arc<SubsetCaptions>>,
    /// That subset's place in the config's list (`crate::config::DatasetConfigPlan::subsets`).
    pub subset: Option<usize>,
    /// The loss weight of the OneTrainer concept the image comes from (its `loss_weight`), with
    /// `prior_loss_weight`'s on a regularization image; 1 for every other image.
    pub loss_weight: f64,
}

impl Default for ItemOptions {
    fn default() -> Self {
        Self {
            rating: 1.0,
            flip_p: None,
            cond_dropout: None,
            shuffle_tags: false,
            main: String::new(),
            tags: Vec::new(),
            tag_weights: None,
            max_caption_length: super::image_config::DEFAULT_MAX_CAPTION_LENGTH,
            prior_loss_weight: None,
            subset_captions: None,
            subset: None,
            loss_weight: 1.0,
        }
    }
}

/// `tags` with the first `keep` in place and the rest shuffled by `rng` (EveryDream2's
/// `__get_shuffled_tags` with `keep_tags` honoured, see the file header).
pub fn shuffled_tags(tags: &[String], keep: usize, rng: &mut PyRandom) -> Vec<String> {
    let mut out = tags.to_vec();
    if out.len() > keep {
        rng.shuffle(&mut out[keep..]);
    }
    out
}

/// EveryDream2's `__get_weighted_shuffled_tags`: the tags joined with `", "`, drawn by weight
/// until none is left or the text reaches `max_len` characters.
pub fn weighted_tags(tags: &[String], weights: &[f64], max_len: i64, rng: &mut PyRandom) -> String {
    let mut tags: Vec<&String> = tags.iter().collect();
    let mut weights: Vec<f64> = weights.to_vec();
    weights.resize(tags.len(), 1.0);
    let mut caption = String::new();
    let mut chars = 0i64;
    while !tags.is_empty() && chars < max_len {
        let mut cumulative = Vec::with_capacity(weights.len());
        let mut sum = 0.0;
        for w in &weights {
            sum += w;
            cumulative.push(sum);
        }
        let point = rng.uniform(0.0, sum);
        let pos = cumulative
            .partition_point(|&c| c < point)
            .min(tags.len() - 1);
        weights.remove(pos);
        let tag = tags.remove(pos);
        if !caption.is_empty() {
            caption.push_str(", ");
            chars += 2;
        }
        caption.push_str(tag);
        chars += tag.chars().count() as i64;
    }
    caption
}

/// The caption of a sample whose tags are shuffled: `options`' main prompt and tags (or, when it
/// has none, `caption` split on commas), the tags shuffled by a [`PyRandom`] seeded with `seed`.
pub fn shuffled_caption(caption: &str, options: &ItemOptions, keep: usize, seed: u64) -> String {
    let mut rng = PyRandom::new(seed);
    let (main, tags) = if options.main.is_empty() && options.tags.is_empty() {
        let mut pieces = caption.split(',').map(str::trim);
        let main = pieces.next().unwrap_or_default().to_string();
        let tags: Vec<String> = pieces
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect();
        (main, tags)
    } else {
        (options.main.clone(), options.tags.clone())
    };
    if tags.is_empty() {
        return main;
    }
    let shuffled = match &options.tag_weights {
        Some(weights) => {
            let max_len = options.max_caption_length as i64 - main.chars().count() as i64;
            weighted_tags(&tags, weights, max_len, &mut rng)
        }
        None => shuffled_tags(&tags, keep, &mut rng).join(", "),
    };
    if main.is_empty() {
        shuffled
    } else {
        format!("{main}, {shuffled}")
    }
}

/// kohya's `caption_tag_dropout_rate` (`process_caption`'s `dropout_tags`): the caption's
/// comma-separated pieces, trimmed, with the first `1 + keep` (the main prompt and the tags
/// `keep_tags` keeps; kohya's `keep_tokens` counts the first piece too) always kept and each
/// other one dropped with probability `rate` (one draw per piece, in order), joined with `", "`
/// as kohya joins them. Empty pieces go, as in kohya.
pub fn drop_tags<R: rand::Rng>(caption: &str, keep: usize, rate: f64, rng: &mut R) -> String {
    let pieces: Vec<&str> = caption
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let fixed = pieces.len().min(keep.saturating_add(1));
    let mut kept: Vec<&str> = pieces[..fixed].to_vec();
    for piece in &pieces[fixed..] {
        if rng.random::<f64>() >= rate {
            kept.push(piece);
        }
    }
    kept.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kept_tags_stay_and_the_rest_is_a_permutation() {
        let tags = strings(&["a", "b", "c", "d", "e", "f"]);
        for seed in 0..20 {
            let out = shuffled_tags(&tags, 2, &mut PyRandom::new(seed));
            assert_eq!(out[..2], tags[..2]);
            let mut rest = out[2..].to_vec();
            rest.sort();
            assert_eq!(rest, tags[2..]);
        }
        assert_eq!(shuffled_tags(&tags, 6, &mut PyRandom::new(1)), tags);
        assert_eq!(shuffled_tags(&tags, 60, &mut PyRandom::new(1)), tags);
    }

    #[test]
    fn weighted_stops_after_crossing_the_length() {
        let tags = strings(&["aaaa", "bbbb", "cccc"]);
        let out = weighted_tags(&tags, &[1.0, 2.0, 3.0], 5, &mut PyRandom::new(3));
        // The first tag (4 chars) is under 5, so a second is added; then 10 ≥ 5 stops.
        assert_eq!(out.len(), 10, "{out}");
        let all = weighted_tags(&tags, &[1.0, 2.0, 3.0], 2048, &mut PyRandom::new(3));
        assert_eq!(all.len(), 16);
    }

    #[test]
    fn a_caption_without_parts_is_split_and_the_main_prompt_stays_first() {
        let o = ItemOptions::default();
        let out = shuffled_caption("main, t1, t2, t3, t4", &o, 1, 9);
        assert!(out.starts_with("main, t1, "), "{out}");
        assert_eq!(shuffled_caption("only", &o, 0, 9), "only");
    }

    /// Catches the main prompt or a kept tag dropped, the rate inverted, and pieces joined
    /// without kohya's `", "`.
    #[test]
    fn tag_dropout_keeps_the_fixed_pieces_and_drops_the_rest_at_its_rate() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let caption = "a photo of sks, red,  blue ,, green,yellow";
        assert_eq!(
            drop_tags(caption, 0, 0.0, &mut rng),
            "a photo of sks, red, blue, green, yellow"
        );
        assert_eq!(drop_tags(caption, 0, 1.0, &mut rng), "a photo of sks");
        assert_eq!(
            drop_tags(caption, 2, 1.0, &mut rng),
            "a photo of sks, red, blue"
        );
        assert_eq!(
            drop_tags(caption, 9, 1.0, &mut rng),
            "a photo of sks, red, blue, green, yellow"
        );
        let (trials, mut kept) = (20_000, 0usize);
        for _ in 0..trials {
            let out = drop_tags("main, t", 0, 0.3, &mut rng);
            assert!(out.starts_with("main"));
            kept += usize::from(out == "main, t");
        }
        // P(kept) = 0.7; 4σ of a binomial over 20000 trials is 0.013.
        let share = kept as f64 / trials as f64;
        assert!((share - 0.7).abs() < 0.013, "{share}");
    }
}
