//! [`RegularizationPlan`]: `reg_data_root` and `prior_loss_weight` (kohya's `reg_data_dir` and
//! `prior_loss_weight`; diffusers' DreamBooth `class_data_dir` with prior preservation), read in
//! the run's `data_layout` (`super::layout_plan`). What the regularization set does in training:
//! `crate::data::regularization`; the layouts: `crate::data::kohya_layout`.
//!
//! `prior_loss_weight` is refused without `reg_data_root` (it would do nothing), and
//! `reg_data_root` beside Hugging Face's imagefolder layout (diffusers' text-to-image scripts read
//! none).
//! `reg_data_root` may not hold `data_root` or lie inside it, where the same images would train
//! as both; it does not combine with `rated_dataset`, whose shrinking epochs kohya's one-time
//! balance cannot follow.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::data::DataLayout;

/// kohya's and diffusers' `prior_loss_weight` default.
pub const DEFAULT_PRIOR_LOSS_WEIGHT: f64 = 1.0;
/// diffusers' `train_dreambooth.py` `--num_class_images` default.
pub const DEFAULT_NUM_CLASS_IMAGES: i64 = 100;
/// The most class images a run draws.
const MAX_CLASS_IMAGES: i64 = 100_000;

/// Regularization images, when `reg_data_root` is set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegularizationPlan {
    /// Absolute path of an existing folder, read in the run's `data_layout`.
    pub data_root: PathBuf,
    /// The loss weight of each regularization sample, ≥ 0.
    pub prior_loss_weight: f64,
    /// Class images drawn before training when the folder holds too few.
    pub class_images: Option<ClassImagesPlan>,
}

/// diffusers' `class_prompt` and `num_class_images`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassImagesPlan {
    pub prompt: String,
    /// The images `reg_data_root` should hold, ≥ 1.
    pub count: usize,
}

/// A caption extension with its leading dot (kohya adds none; ".txt" and "txt" both mean the
/// `.txt` file here), or why it is not one.
pub(super) fn caption_extension(raw: &str) -> Result<String, String> {
    let ext = raw.trim();
    let bare = ext.strip_prefix('.').unwrap_or(ext);
    if bare.is_empty() || bare.contains(['/', '\\', '\0']) {
        return Err(format!(
            "must be a file extension such as \".txt\" or \".caption\" (got \"{ext}\")"
        ));
    }
    Ok(format!(".{bare}"))
}

/// `reg_data_root` and `prior_loss_weight`, given the resolved `data_root` and layout.
pub(super) fn resolve_regularization(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    data_root: &Path,
    layout: &DataLayout,
) -> Result<Option<RegularizationPlan>, ConfigError> {
    if let (Some(_), DataLayout::ImageFolder { .. }) = (&file.reg_data_root, layout) {
        return Err(ctx.invalid(
            "reg_data_root",
            "is not read beside Hugging Face's imagefolder layout (data_layout \"imagefolder\"), \
             which diffusers' text-to-image scripts train without class images; use EveryDream2's \
             or kohya's layout for a run with regularization images"
                .into(),
        ));
    }
    let Some(raw) = file.reg_data_root.as_deref() else {
        let orphan = [
            ("prior_loss_weight", file.prior_loss_weight.is_some()),
            ("class_prompt", file.class_prompt.is_some()),
            ("num_class_images", file.num_class_images.is_some()),
        ];
        if let Some((key, _)) = orphan.iter().find(|(_, set)| *set) {
            return Err(ctx.invalid(
                key,
                "applies to the regularization images, but `reg_data_root` is not set; set it to \
                 the folder of class images, or leave this key out"
                    .into(),
            ));
        }
        return Ok(None);
    };
    let root = ctx.input_path("reg_data_root", raw)?;
    let class_images = resolve_class_images(file, ctx)?;
    // A folder class images are drawn into may not exist yet (diffusers creates it).
    let may_be_made = class_images.is_some() && !root.exists();
    if !root.is_dir() && !may_be_made {
        let problem = match root.exists() {
            true => "is not a folder",
            false => "does not exist",
        };
        return Err(ctx.invalid("reg_data_root", format!("{} {problem}", root.display())));
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a.starts_with(b),
        _ => a.starts_with(b),
    };
    if same(&root, data_root) || same(data_root, &root) {
        return Err(ctx.invalid(
            "reg_data_root",
            format!(
                "{} and data_root {} hold one another; the regularization images need a folder \
                 of their own",
                root.display(),
                data_root.display()
            ),
        ));
    }
    if file.rated_dataset == Some(true) {
        return Err(ctx.invalid(
            "reg_data_root",
            "does not combine with rated_dataset: the regularization set is sized once to the \
             training set (as kohya sizes it), which rated_dataset shrinks epoch by epoch"
                .into(),
        ));
    }
    let weight = file.prior_loss_weight.unwrap_or(DEFAULT_PRIOR_LOSS_WEIGHT);
    if !(weight.is_finite() && weight >= 0.0) {
        return Err(ctx.invalid(
            "prior_loss_weight",
            format!("must be a finite number ≥ 0 (got {weight})"),
        ));
    }
    if let (Some(class), DataLayout::Kohya { .. }) = (&class_images, layout) {
        check_folder_name(ctx, &class.prompt)?;
    }
    Ok(Some(RegularizationPlan {
        data_root: root,
        prior_loss_weight: weight,
        class_images,
    }))
}

/// `class_prompt` and `num_class_images` (diffusers' default 100).
fn resolve_class_images(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<ClassImagesPlan>, ConfigError> {
    let Some(prompt) = file.class_prompt.as_deref() else {
        if file.num_class_images.is_some() {
            return Err(ctx.invalid(
                "num_class_images",
                "is how many class images to draw, but `class_prompt` (what to draw) is not set"
                    .into(),
            ));
        }
        return Ok(None);
    };
    if prompt.trim().is_empty() {
        return Err(ctx.invalid(
            "class_prompt",
            "is empty; write the class, such as \"a photo of a dog\"".into(),
        ));
    }
    let count = file.num_class_images.unwrap_or(DEFAULT_NUM_CLASS_IMAGES);
    if !(1..=MAX_CLASS_IMAGES).contains(&count) {
        return Err(ctx.invalid(
            "num_class_images",
            format!("must be between 1 and {MAX_CLASS_IMAGES} (got {count})"),
        ));
    }
    Ok(Some(ClassImagesPlan {
        prompt: prompt.to_string(),
        count: count as usize,
    }))
}

/// kohya's layout draws class images into `1_<class_prompt>`: the prompt must name a folder.
fn check_folder_name(ctx: &Ctx<'_>, prompt: &str) -> Result<(), ConfigError> {
    let bad = prompt.contains(['/', '\\', '\0']) || prompt.chars().any(char::is_control);
    if bad || prompt.len() > 200 || prompt.starts_with('.') || prompt != prompt.trim() {
        return Err(ctx.invalid(
            "class_prompt",
            format!(
                "names the kohya folder `1_<class_prompt>` the class images are drawn into, and \
                 \"{prompt}\" cannot name a folder (no `/`, `\\`, control characters, leading \
                 `.` or outer spaces; at most 200 bytes); shorten it, or use EveryDream2's layout, \
                 which writes the prompt into caption files"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::layout_plan::resolve_layout;
    use super::*;
    use serde_json::json;

    fn file(v: serde_json::Value) -> TrainFile {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn regularization_keys_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let (data, reg) = (dir.path().join("data"), dir.path().join("reg"));
        std::fs::create_dir_all(data.join("inner")).unwrap();
        std::fs::create_dir_all(&reg).unwrap();
        let ctx = Ctx::new(Path::new("train.json"));
        let resolve = |v: serde_json::Value| {
            let f = file(v);
            let layout = resolve_layout(&f, &ctx, None)?;
            resolve_regularization(&f, &ctx, &data, &layout)
        };
        let s = |p: &Path| p.display().to_string();
        assert_eq!(resolve(json!({})).unwrap(), None);
        let plan = resolve(json!({"reg_data_root": s(&reg)})).unwrap().unwrap();
        assert_eq!(plan.prior_loss_weight, 1.0);
        let plan = resolve(json!({"reg_data_root": s(&reg), "prior_loss_weight": 0.0}));
        assert_eq!(plan.unwrap().unwrap().prior_loss_weight, 0.0);
        // class images: diffusers' default count, and a folder that is made when missing
        let to_make = dir.path().join("class");
        let plan = resolve(json!({"reg_data_root": s(&to_make), "class_prompt": "a dog"}));
        let class = plan.unwrap().unwrap().class_images.unwrap();
        assert_eq!((class.prompt.as_str(), class.count), ("a dog", 100));
        let plan = resolve(json!({"reg_data_root": s(&to_make), "class_prompt": "a/b"}));
        assert!(
            plan.is_ok(),
            "EveryDream2's layout writes the prompt into caption files"
        );
        for (v, key, says) in [
            (
                json!({"prior_loss_weight": 1.0}),
                "prior_loss_weight",
                "reg_data_root",
            ),
            (
                json!({"reg_data_root": s(&reg), "prior_loss_weight": -1.0}),
                "prior_loss_weight",
                "≥ 0",
            ),
            (
                json!({"reg_data_root": s(&dir.path().join("no"))}),
                "reg_data_root",
                "does not exist",
            ),
            (
                json!({"reg_data_root": s(&data.join("inner"))}),
                "reg_data_root",
                "hold one another",
            ),
            (
                json!({"reg_data_root": s(dir.path())}),
                "reg_data_root",
                "hold one another",
            ),
            (
                json!({"reg_data_root": s(&reg), "rated_dataset": true}),
                "reg_data_root",
                "rated_dataset",
            ),
        ] {
            let msg = resolve(v.clone()).unwrap_err().to_string();
            assert!(msg.contains(key) && msg.contains(says), "{v}: {msg}");
        }
    }
}
