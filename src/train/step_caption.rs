//! The caption a sample trains with in one step, from its caption (or textual inversion's
//! template) and the step's settings, in kohya's `process_caption` order: caption dropout,
//! wildcards (`enable_wildcard`), the tag shuffle and tag dropout (of the middle part alone when
//! the caption holds kohya's `keep_tokens_separator`), then the secondary separator.
//!
//! Every draw comes from the sample's own generator, and each is made whether or not the caption
//! was dropped, so a dropped caption moves none of the draws after it (the VAE sample, the
//! noise, the timestep). A setting that is off makes no draw.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::step::{CaptionClock, StepSettings};
use crate::data::augment;
use crate::data::kohya_caption::{
    expand_wildcards, replace_secondary, replace_secondary_with, split_kept, split_kept_on,
    SubsetCaptions, TagDropoutMode,
};
use crate::data::py_random::PyRandom;
use crate::data::tag_shuffle::{drop_tags, shuffled_caption, shuffled_tags};
use crate::data::ItemOptions;

/// `caption` as sample `own` trains with it this step (draws from `rng`).
pub(super) fn step_caption<R: Rng>(
    caption: &str,
    own: &ItemOptions,
    settings: &StepSettings<'_>,
    rng: &mut R,
) -> String {
    let dropout = own.cond_dropout.unwrap_or(settings.cond_dropout);
    let caption = augment::cond_dropout(caption, dropout, rng);
    if let Some(rules) = own.subset_captions.as_deref() {
        return subset_caption(caption, rules, settings.clock, rng);
    }
    let kohya = settings.kohya_captions;
    // kohya's `caption_dropout_every_n_epochs`, after the dropout's draw.
    let epoch_drops = settings
        .clock
        .epoch
        .is_some_and(|e| kohya.is_some_and(|k| k.drops_epoch(e)));
    let caption = if epoch_drops { "" } else { caption };
    let caption = match kohya.filter(|k| k.wildcard) {
        Some(_) => expand_wildcards(caption, &mut StdRng::seed_from_u64(rng.random::<u64>())),
        None => caption.to_string(),
    };
    let shuffle = settings.shuffle_tags || own.shuffle_tags;
    let warmup = kohya.and_then(|k| k.token_warmup);
    // How many middle tags the token warmup lets through at this step.
    let clock = settings.clock;
    let warm = |flex: usize| warmup.and_then(|w| w.tags_at(flex, clock.step, clock.total_steps));
    let kept = kohya
        .and_then(|k| k.keep_tokens_separator.as_deref())
        .filter(|_| shuffle || settings.tag_dropout > 0.0 || warmup.is_some())
        .and_then(|separator| split_kept(&caption, separator));
    let out = match kept {
        Some((fixed, mut flex, suffix)) => {
            if let Some(n) = warm(flex.len()) {
                flex.truncate(n);
            }
            let flex = shuffled_and_dropped(
                flex,
                shuffle,
                settings.tag_dropout,
                TagDropoutMode::PerTag,
                rng,
            );
            let all: Vec<String> = fixed.into_iter().chain(flex).chain(suffix).collect();
            all.join(", ")
        }
        None => {
            let caption = match warmup.filter(|_| !caption.is_empty()) {
                Some(_) => warmed_up(&caption, settings.keep_tags, &warm),
                None => caption,
            };
            shuffled_then_dropped(&caption, own, shuffle, settings, rng)
        }
    };
    replace_secondary(&out, kohya.and_then(|k| k.secondary_separator.as_deref()))
}

/// A dataset-config subset's caption after the dropout draw: kohya's `process_caption` with the
/// subset's own settings (`keep_tokens` counting from the first piece, pieces split on its
/// `caption_separator` and kept even when empty, as kohya keeps them), drawing as
/// [`step_caption`] does.
fn subset_caption<R: Rng>(
    caption: &str,
    rules: &SubsetCaptions,
    clock: CaptionClock,
    rng: &mut R,
) -> String {
    let keys = &rules.keys;
    let epoch_drops = clock.epoch.is_some_and(|e| keys.drops_epoch(e));
    let caption = if epoch_drops { "" } else { caption };
    let caption = match (keys.wildcard, keys.random_line) {
        (true, _) => expand_wildcards(caption, &mut StdRng::seed_from_u64(rng.random::<u64>())),
        (false, true) => crate::data::kohya_caption::random_line(
            caption,
            &mut StdRng::seed_from_u64(rng.random::<u64>()),
        ),
        _ => caption.to_string(),
    };
    let warmup = keys.token_warmup;
    let sep = rules.separator.as_str();
    let out = if rules.shuffle || rules.tag_dropout > 0.0 || warmup.is_some() {
        let kept = keys
            .keep_tokens_separator
            .as_deref()
            .and_then(|s| split_kept_on(&caption, s, sep));
        let (fixed, mut flex, suffix) = kept.unwrap_or_else(|| {
            let pieces: Vec<String> = caption
                .trim()
                .split(sep)
                .map(|t| t.trim().to_string())
                .collect();
            let keep = rules.keep_tokens.min(pieces.len());
            (pieces[..keep].to_vec(), pieces[keep..].to_vec(), Vec::new())
        });
        if let Some(n) = warmup.and_then(|w| w.tags_at(flex.len(), clock.step, clock.total_steps)) {
            flex.truncate(n);
        }
        let flex = shuffled_and_dropped(
            flex,
            rules.shuffle,
            rules.tag_dropout,
            rules.tag_dropout_mode,
            rng,
        );
        let all: Vec<String> = fixed.into_iter().chain(flex).chain(suffix).collect();
        all.join(", ")
    } else {
        caption
    };
    replace_secondary_with(&out, keys.secondary_separator.as_deref(), sep)
}

/// kohya's token warmup on a caption without the keep separator: its pieces trimmed, the first
/// `1 + keep` fixed (kohya's `keep_tokens`; sdtrain's `keep_tags` counts after the main prompt),
/// the rest cut to what `warm` lets through, rejoined with `", "` as kohya rejoins them.
fn warmed_up(caption: &str, keep: usize, warm: &dyn Fn(usize) -> Option<usize>) -> String {
    let pieces: Vec<&str> = caption.trim().split(',').map(str::trim).collect();
    let fixed = pieces.len().min(keep.saturating_add(1));
    let (fixed, mut flex) = (pieces[..fixed].to_vec(), pieces[fixed..].to_vec());
    if let Some(n) = warm(flex.len()) {
        flex.truncate(n);
    }
    fixed.into_iter().chain(flex).collect::<Vec<_>>().join(", ")
}

/// kohya's middle part: shuffled (a [`PyRandom`] seeded by one draw, as every shuffle here), then
/// each tag dropped with probability `rate` (one draw seeds the tag draws).
/// With OneTrainer's RANDOM WEIGHTED the tags are dropped first, by their place in the caption,
/// then shuffled (its `DropTags` runs before `ShuffleTags`); the draws are the same two.
fn shuffled_and_dropped<R: Rng>(
    flex: Vec<String>,
    shuffle: bool,
    rate: f64,
    mode: TagDropoutMode,
    rng: &mut R,
) -> Vec<String> {
    let shuffle_seed = shuffle.then(|| rng.random::<u32>());
    let drop_seed = (rate > 0.0).then(|| rng.random::<u64>());
    let drop = |mut tags: Vec<String>| {
        if let Some(seed) = drop_seed {
            mode.drop_tags(&mut tags, rate, &mut StdRng::seed_from_u64(seed));
        }
        tags
    };
    let shuffled = |tags: Vec<String>| match shuffle_seed {
        Some(seed) => shuffled_tags(&tags, 0, &mut PyRandom::new(u64::from(seed))),
        None => tags,
    };
    match mode {
        TagDropoutMode::Weighted => shuffled(drop(flex)),
        _ => drop(shuffled(flex)),
    }
}

/// A caption without kohya's separator: EveryDream2's shuffle (the main prompt and `keep_tags`
/// stay), then kohya's tag dropout.
fn shuffled_then_dropped<R: Rng>(
    caption: &str,
    own: &ItemOptions,
    shuffle: bool,
    settings: &StepSettings<'_>,
    rng: &mut R,
) -> String {
    let mut out = if shuffle {
        // One draw whether or not the caption was dropped.
        let seed = rng.random::<u32>();
        match caption.is_empty() {
            true => String::new(),
            false => shuffled_caption(caption, own, settings.keep_tags, u64::from(seed)),
        }
    } else {
        caption.to_string()
    };
    if settings.tag_dropout > 0.0 {
        // One draw whether or not the caption was dropped; after the shuffle, as kohya.
        let mut tags_rng = StdRng::seed_from_u64(rng.random::<u64>());
        if !out.is_empty() {
            out = drop_tags(
                &out,
                settings.keep_tags,
                settings.tag_dropout,
                &mut tags_rng,
            );
        }
    }
    out
}
