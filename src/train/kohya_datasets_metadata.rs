//! The dataset part of kohya's metadata for a run on a dataset config (kohya's
//! `train_network.py`, its `use_user_config` branch): `ss_datasets` (each dataset and its
//! subsets), `ss_tag_frequency` and `ss_dataset_dirs` merged over the datasets, named by each
//! subset's folder (or metadata file) name. The single-dataset keys (`ss_batch_size_per_device`,
//! `ss_dataset_dirs` of folders, `ss_bucket_info`, …) are not written, as kohya writes none of
//! them in this branch.

use std::collections::BTreeMap;
use std::path::Path;

use super::kohya_run_metadata::{bucket_info, tag_frequency, RunFacts};
use crate::config::DatasetConfigPlan;
use crate::data::kohya_subsets::{KohyaSubset, SubsetSource};
use crate::data::{Bucket, ImageMeta};
use crate::py_json::PyValue;

/// Writes the keys into `m`.
pub(super) fn write(
    f: &RunFacts<'_>,
    config: &DatasetConfigPlan,
    m: &mut BTreeMap<String, String>,
) {
    let datasets = config
        .subsets
        .iter()
        .map(|s| s.dataset)
        .max()
        .map_or(0, |d| d + 1);
    let own_reg: &[ImageMeta] = f.regularization.map_or(&[], |r| &r.own);
    let mut all = Vec::new();
    let mut merged_tags: Vec<(String, PyValue)> = Vec::new();
    let mut dirs: Vec<(String, PyValue)> = Vec::new();
    for d in 0..datasets {
        let subsets: Vec<&KohyaSubset> = config.subsets.iter().filter(|s| s.dataset == d).collect();
        if subsets.is_empty() {
            continue;
        }
        let ds = DatasetImages::of(f, own_reg, &subsets);
        let tags = ds.tag_frequency(&subsets);
        if let PyValue::Dict(entries) = &tags {
            for (name, counts) in entries {
                if !merged_tags.iter().any(|(n, _)| n == name) {
                    merged_tags.push((name.clone(), counts.clone()));
                }
            }
        }
        for s in subsets.iter().filter(|s| !s.is_reg) {
            let base = name_of(s);
            let mut name = base.clone();
            let mut i = 2;
            while dirs.iter().any(|(n, _)| *n == name) {
                name = format!("{base} ({i})");
                i += 1;
            }
            let entry = vec![
                ("n_repeats".into(), PyValue::Int(s.num_repeats as i64)),
                ("img_count".into(), PyValue::Int(ds.count(s) as i64)),
            ];
            dirs.push((name, PyValue::Dict(entry)));
        }
        all.push(ds.metadata(f, &subsets, tags));
    }
    let mut put = |k: &str, v: PyValue| {
        m.insert(k.to_string(), v.dumps());
    };
    put("ss_datasets", PyValue::List(all));
    put("ss_tag_frequency", PyValue::Dict(merged_tags));
    put("ss_dataset_dirs", PyValue::Dict(dirs));
}

/// kohya's name for a subset: its folder's, or for a fine-tuning subset its metadata file's.
fn name_of(s: &KohyaSubset) -> String {
    let path = match &s.source {
        SubsetSource::DreamBooth { image_dir, .. } => image_dir.as_path(),
        SubsetSource::FineTuning { metadata_file, .. } => metadata_file.as_path(),
        SubsetSource::Concept { image_dir, .. } => image_dir.as_path(),
    };
    base_name(path)
}

fn base_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// One dataset's images: its training images (as trained, with their buckets) and its
/// regularization images as read (their own repeats, before balancing).
struct DatasetImages<'a> {
    /// Every sample as it trains (the regularization ones balanced), with its bucket.
    trained: Vec<(&'a ImageMeta, Bucket)>,
    train: Vec<(&'a ImageMeta, Bucket)>,
    reg: Vec<&'a ImageMeta>,
}

impl<'a> DatasetImages<'a> {
    fn of(f: &RunFacts<'a>, own_reg: &'a [ImageMeta], subsets: &[&KohyaSubset]) -> Self {
        let mine = |i: &ImageMeta| subsets.iter().any(|s| i.options.subset == Some(s.index));
        let trained: Vec<(&ImageMeta, Bucket)> = f
            .items
            .iter()
            .zip(f.buckets.iter().copied())
            .filter(|(i, _)| mine(i))
            .collect();
        let train = trained
            .iter()
            .copied()
            .filter(|(i, _)| i.options.prior_loss_weight.is_none())
            .collect();
        let reg = own_reg.iter().filter(|i| mine(i)).collect();
        Self {
            trained,
            train,
            reg,
        }
    }

    fn images(&self, s: &KohyaSubset) -> Vec<&'a ImageMeta> {
        let of = |i: &&ImageMeta| i.options.subset == Some(s.index);
        match s.is_reg {
            true => self.reg.iter().copied().filter(of).collect(),
            false => self.train.iter().map(|(i, _)| *i).filter(of).collect(),
        }
    }

    fn count(&self, s: &KohyaSubset) -> usize {
        self.images(s).len()
    }

    /// kohya's `tag_frequency` of the dataset: every subset's captions (regularization ones
    /// too) by subset name, a name used twice counted together.
    fn tag_frequency(&self, subsets: &[&KohyaSubset]) -> PyValue {
        let mut captions: Vec<(String, Vec<&str>)> = Vec::new();
        for s in subsets {
            let name = name_of(s);
            let images = self.images(s);
            let caps = images.iter().map(|i| i.caption.as_str());
            match captions.iter_mut().find(|(n, _)| *n == name) {
                Some((_, list)) => list.extend(caps),
                None => captions.push((name, caps.collect())),
            }
        }
        tag_frequency(&captions)
    }

    /// The dataset's entry of `ss_datasets`.
    fn metadata(&self, f: &RunFacts<'_>, subsets: &[&KohyaSubset], tags: PyValue) -> PyValue {
        // This dataset's resolution, batch size and buckets.
        let shapes = f.plan.dataset_shapes();
        let dataset = subsets.first().map_or(0, |s| s.dataset);
        let Some(d) = shapes.get(dataset).or(shapes.first()) else {
            return PyValue::None;
        };
        let repeats = |items: &mut dyn Iterator<Item = &ImageMeta>| -> i64 {
            items.map(|i| i.multiplier).sum::<f64>().round() as i64
        };
        let dreambooth = subsets.iter().all(|s| {
            matches!(
                s.source,
                SubsetSource::DreamBooth { .. } | SubsetSource::Concept { .. }
            )
        });
        let side = d
            .resolution
            .unwrap_or_else(|| f.buckets.first().map_or(0, |b| b.width)) as i64;
        let (min, max) = match (&d.buckets, d.buckets.as_ref().and_then(|b| b.kohya)) {
            (None, _) => (PyValue::None, PyValue::None),
            (Some(_), Some(k)) => (PyValue::Int(k.min as i64), PyValue::Int(k.max as i64)),
            (Some(_), None) => {
                let sides = self.train.iter().flat_map(|(_, b)| [b.width, b.height]);
                let min = sides.clone().min().unwrap_or(0) as i64;
                (
                    PyValue::Int(min),
                    PyValue::Int(sides.max().unwrap_or(0) as i64),
                )
            }
        };
        // kohya's buckets hold the regularization samples too.
        let items: Vec<ImageMeta> = self.trained.iter().map(|(i, _)| (*i).clone()).collect();
        let buckets: Vec<Bucket> = self.trained.iter().map(|(_, b)| *b).collect();
        let entry = vec![
            ("is_dreambooth".into(), PyValue::Bool(dreambooth)),
            (
                "batch_size_per_device".into(),
                PyValue::Int(d.batch_size as i64),
            ),
            (
                "num_train_images".into(),
                PyValue::Int(repeats(&mut self.train.iter().map(|(i, _)| *i))),
            ),
            (
                "num_reg_images".into(),
                PyValue::Int(repeats(&mut self.reg.iter().copied())),
            ),
            (
                "resolution".into(),
                PyValue::List(vec![PyValue::Int(side), PyValue::Int(side)]),
            ),
            ("enable_bucket".into(), PyValue::Bool(d.buckets.is_some())),
            ("min_bucket_reso".into(), min),
            ("max_bucket_reso".into(), max),
            ("tag_frequency".into(), tags),
            ("bucket_info".into(), bucket_info(&items, &buckets)),
            ("resize_interpolation".into(), PyValue::None),
            (
                "subsets".into(),
                PyValue::List(subsets.iter().map(|s| self.subset(s, dreambooth)).collect()),
            ),
        ];
        PyValue::Dict(entry)
    }

    /// A subset's entry, with kohya's keys.
    fn subset(&self, s: &KohyaSubset, dreambooth: bool) -> PyValue {
        let c = &s.captions;
        let text = |v: &Option<String>| v.clone().map_or(PyValue::None, PyValue::Str);
        let mut entry = vec![
            ("img_count".into(), PyValue::Int(self.count(s) as i64)),
            ("num_repeats".into(), PyValue::Int(s.num_repeats as i64)),
            ("color_aug".into(), PyValue::Bool(false)),
            ("flip_aug".into(), PyValue::Bool(s.flip_p > 0.0)),
            ("random_crop".into(), PyValue::Bool(false)),
            ("shuffle_caption".into(), PyValue::Bool(c.shuffle)),
            ("keep_tokens".into(), PyValue::Int(c.keep_tokens as i64)),
            (
                "keep_tokens_separator".into(),
                // kohya's command-line default is "".
                PyValue::Str(c.keys.keep_tokens_separator.clone().unwrap_or_default()),
            ),
            (
                "secondary_separator".into(),
                text(&c.keys.secondary_separator),
            ),
            ("enable_wildcard".into(), PyValue::Bool(c.keys.wildcard)),
            ("caption_prefix".into(), text(&s.caption_prefix)),
            ("caption_suffix".into(), text(&s.caption_suffix)),
            ("resize_interpolation".into(), PyValue::None),
        ];
        match &s.source {
            SubsetSource::DreamBooth {
                image_dir,
                class_tokens,
                ..
            } => {
                entry.push(("image_dir".into(), PyValue::Str(base_name(image_dir))));
                if dreambooth {
                    entry.push(("class_tokens".into(), text(class_tokens)));
                    entry.push(("is_reg".into(), PyValue::Bool(s.is_reg)));
                }
            }
            SubsetSource::Concept { image_dir, .. } => {
                entry.push(("image_dir".into(), PyValue::Str(base_name(image_dir))));
                if dreambooth {
                    entry.push(("class_tokens".into(), PyValue::None));
                    entry.push(("is_reg".into(), PyValue::Bool(s.is_reg)));
                }
            }
            SubsetSource::FineTuning {
                metadata_file,
                image_dir,
            } => {
                if let Some(dir) = image_dir {
                    entry.push(("image_dir".into(), PyValue::Str(base_name(dir))));
                }
                entry.push((
                    "metadata_file".into(),
                    PyValue::Str(base_name(metadata_file)),
                ));
            }
        }
        PyValue::Dict(entry)
    }
}
