//! A dataset config's images as the trainer loads them ([`crate::config::DatasetConfigPlan`]):
//! every training subset's images in one set, each carrying its subset's settings, and each
//! dataset's regularization (`is_reg`) subsets balanced against that dataset's training samples
//! (kohya's `DreamBoothDataset`: per dataset, after the validation split).

use std::collections::HashSet;
use std::path::PathBuf;

use crate::config::DatasetConfigPlan;
use crate::data::dataset::load_records;
use crate::data::kohya_subsets::scan_subset;
use crate::data::regularization::{add_regularization_against, RegularizationSummary};
use crate::data::{ImageRecord, LoadedDataset};

/// The config's images: the training set, and per dataset its regularization images with the
/// paths of its training images (to count its samples once validation images are held out).
pub(super) struct SubsetImages {
    pub train: LoadedDataset,
    reg: Vec<DatasetReg>,
}

/// One dataset's regularization images, not yet added.
pub(super) struct DatasetReg {
    dataset: usize,
    images: LoadedDataset,
    train_paths: HashSet<PathBuf>,
}

/// Scans every subset (announcing each), then reads the images' headers.
pub(super) fn load_subsets(
    config: &DatasetConfigPlan,
    max_pixels: u64,
    show_progress: bool,
) -> anyhow::Result<SubsetImages> {
    let root = config
        .file
        .parent()
        .map_or_else(|| config.file.clone(), |p| p.to_path_buf());
    let mut train: Vec<ImageRecord> = Vec::new();
    // Per dataset: its regularization records and its training paths.
    let mut per_dataset: Vec<(Vec<ImageRecord>, HashSet<PathBuf>)> = Vec::new();
    let mut seen: Vec<(usize, PathBuf)> = Vec::new();
    for subset in &config.subsets {
        let place = (subset.dataset, subset.location().to_path_buf());
        // OneTrainer trains two concepts of one folder both (their seeds or settings differ).
        let concept = matches!(
            subset.source,
            crate::data::kohya_subsets::SubsetSource::Concept { .. }
        );
        if seen.contains(&place) && !concept {
            crate::console::say(format_args!(
                "warning: dataset config {}: {} repeats an earlier subset's {}, not used (as kohya)",
                config.file.display(),
                subset.name,
                subset.location().display()
            ));
            continue;
        }
        seen.push(place);
        let records = scan_subset(subset)?;
        // A OneTrainer concept's balancing may be a fraction (its images' multiplier).
        let repeats = match subset.source {
            crate::data::kohya_subsets::SubsetSource::Concept { .. } => {
                records.first().map_or(1.0, |r| r.multiplier)
            }
            _ => subset.num_repeats as f64,
        };
        crate::console::say(format_args!(
            "{}{}: {} image{} × {} repeat{} from {}",
            subset.name,
            if subset.is_reg {
                " (regularization)"
            } else {
                ""
            },
            records.len(),
            if records.len() == 1 { "" } else { "s" },
            repeats,
            if repeats == 1.0 { "" } else { "s" },
            subset.location().display()
        ));
        if per_dataset.len() <= subset.dataset {
            per_dataset.resize_with(subset.dataset + 1, Default::default);
        }
        let slot = &mut per_dataset[subset.dataset];
        if subset.is_reg {
            slot.0.extend(records);
        } else {
            slot.1.extend(records.iter().map(|r| r.path.clone()));
            train.extend(records);
        }
    }
    let train = load_records(&train, show_progress, "dataset_config", &root, max_pixels)?;
    let mut reg = Vec::new();
    for (dataset, (records, train_paths)) in per_dataset.into_iter().enumerate() {
        if records.is_empty() {
            continue;
        }
        let images = load_records(&records, show_progress, "dataset_config", &root, max_pixels)?;
        reg.push(DatasetReg {
            dataset,
            images,
            train_paths,
        });
    }
    Ok(SubsetImages { train, reg })
}

impl SubsetImages {
    /// The regularization images, set aside for [`add_config_regularization`].
    pub(super) fn take_regularization(&mut self) -> Vec<DatasetReg> {
        std::mem::take(&mut self.reg)
    }
}

/// Adds each dataset's regularization images to `train`, balanced against that dataset's
/// training samples in `train` (after the validation split), weighed by `weight`; one summary
/// for them all, or `None` without any.
pub(super) fn add_config_regularization(
    train: &mut LoadedDataset,
    sets: Vec<DatasetReg>,
    weight: f64,
) -> Option<RegularizationSummary> {
    let mut total: Option<RegularizationSummary> = None;
    for set in sets {
        let samples: f64 = train
            .items
            .iter()
            .filter(|i| i.options.prior_loss_weight.is_none() && set.train_paths.contains(&i.path))
            .map(|i| i.multiplier)
            .sum();
        if samples == 0.0 {
            crate::console::say(format_args!(
                "warning: dataset_config datasets[{}]: regularization images but no training \
                 images to balance them against, not used",
                set.dataset
            ));
            continue;
        }
        let s = add_regularization_against(train, set.images, weight, samples);
        total = Some(match total {
            None => s,
            Some(mut t) => {
                t.images += s.images;
                t.used += s.used;
                t.samples_before += s.samples_before;
                t.samples += s.samples;
                t.train_samples += s.train_samples;
                t.own.extend(s.own);
                t
            }
        });
    }
    total
}
