//! kohya sd-scripts' textual-inversion caption templates (`train_textual_inversion.py`'s
//! `imagenet_templates_small` and `imagenet_style_templates_small`, from the textual inversion
//! paper's code; diffusers' `textual_inversion.py` has the same lists): with
//! `embedding.template`, every caption is one of them naming the token, drawn anew each time.

use rand::Rng;

/// `use_object_template`.
pub const OBJECT: &[&str] = &[
    "a photo of a {}",
    "a rendering of a {}",
    "a cropped photo of the {}",
    "the photo of a {}",
    "a photo of a clean {}",
    "a photo of a dirty {}",
    "a dark photo of the {}",
    "a photo of my {}",
    "a photo of the cool {}",
    "a close-up photo of a {}",
    "a bright photo of the {}",
    "a cropped photo of a {}",
    "a photo of the {}",
    "a good photo of the {}",
    "a photo of one {}",
    "a close-up photo of the {}",
    "a rendition of the {}",
    "a photo of the clean {}",
    "a rendition of a {}",
    "a photo of a nice {}",
    "a good photo of a {}",
    "a photo of the nice {}",
    "a photo of the small {}",
    "a photo of the weird {}",
    "a photo of the large {}",
    "a photo of a cool {}",
    "a photo of a small {}",
];

/// `use_style_template`.
pub const STYLE: &[&str] = &[
    "a painting in the style of {}",
    "a rendering in the style of {}",
    "a cropped painting in the style of {}",
    "the painting in the style of {}",
    "a clean painting in the style of {}",
    "a dirty painting in the style of {}",
    "a dark painting in the style of {}",
    "a picture in the style of {}",
    "a cool painting in the style of {}",
    "a close-up painting in the style of {}",
    "a bright painting in the style of {}",
    "a cropped painting in the style of {}",
    "a good painting in the style of {}",
    "a close-up painting in the style of {}",
    "a rendition in the style of {}",
    "a nice painting in the style of {}",
    "a small painting in the style of {}",
    "a weird painting in the style of {}",
    "a large painting in the style of {}",
];

/// Every template of `list` with `token` in its place.
pub fn captions(list: &[&str], token: &str) -> Vec<String> {
    list.iter().map(|t| t.replace("{}", token)).collect()
}

/// One of `captions`, drawn from `rng` (one draw).
pub fn draw<'a>(captions: &'a [String], rng: &mut impl Rng) -> &'a str {
    match captions.len() {
        0 => "",
        n => &captions[rng.random_range(0..n)],
    }
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;

    #[test]
    fn lists_match_kohyas_and_every_caption_names_the_token() {
        assert_eq!((OBJECT.len(), STYLE.len()), (27, 19));
        let c = captions(OBJECT, "mychar");
        assert_eq!(c[0], "a photo of a mychar");
        assert!(c.iter().all(|c| c.contains("mychar") && !c.contains("{}")));
        let mut rng = StdRng::seed_from_u64(3);
        let drawn: std::collections::HashSet<&str> = (0..400).map(|_| draw(&c, &mut rng)).collect();
        assert_eq!(drawn.len(), 27, "every template is drawn");
    }
}
