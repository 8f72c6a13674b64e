//! kohya's bucket keys (`min_bucket_reso`, `max_bucket_reso`, `bucket_reso_steps`, in train.json
//! or a dataset config) against kohya's `make_bucket_resolutions`, and a dataset's validation
//! split against its `split_train_val` (tests/fixtures/kohya_dataset_config_reference.py, run on
//! kohya's own functions).

mod common;

use sdtrain::data::bucket::kohya_buckets;

/// Every size, in kohya's order. Catches the area taken from the longest side instead of the
/// resolution, heights not rounded down to the step, the transposes or the square left out,
/// and the range's ends excluded.
#[test]
fn kohya_bucket_sizes_match_make_bucket_resolutions() {
    let reference = common::reference_json("reference/kohya_dataset_config.json");
    for case in reference["buckets"].as_array().unwrap() {
        let n = |k: &str| case[k].as_u64().unwrap() as usize;
        let got: Vec<[usize; 2]> = kohya_buckets(n("resolution"), n("min"), n("max"), n("steps"))
            .iter()
            .map(|b| [b.width, b.height])
            .collect();
        let want: Vec<[usize; 2]> = case["expected"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                [
                    p[0].as_u64().unwrap() as usize,
                    p[1].as_u64().unwrap() as usize,
                ]
            })
            .collect();
        assert_eq!(got, want, "{case}");
    }
}

/// `bucket_no_upscale`: each image's own bucket as kohya's `BucketManager.select_bucket` picks
/// it. Catches an image under the area scaled up, the larger one's side rounded the wrong way
/// (kohya keeps the rounding whose aspect ratio is closer), and sides not cut to the step.
#[test]
fn no_upscale_buckets_match_select_bucket() {
    let reference = common::reference_json("reference/kohya_dataset_config.json");
    for case in reference["no_upscale"].as_array().unwrap() {
        let n = |k: &str| case[k].as_u64().unwrap() as usize;
        let b = sdtrain::data::bucket::kohya_no_upscale_bucket(
            n("width"),
            n("height"),
            n("resolution"),
            n("steps"),
        );
        let want = &case["expected"];
        assert_eq!(
            [b.width as u64, b.height as u64],
            [want[0].as_u64().unwrap(), want[1].as_u64().unwrap()],
            "{case}"
        );
    }
}

/// A dataset's `validation_split` and `validation_seed`: the images each of kohya's two
/// `split_train_val` calls keeps, by index into the subset's sorted list, in kohya's order.
/// Catches Rust's half-away-from-zero `round` (10 × 0.25 would hold out 3), a floor for the
/// training count's ceiling, the image both halves share dropped from one, and Python's seeding
/// of integers past 32 bits.
#[test]
fn validation_splits_match_split_train_val() {
    let reference = common::reference_json("reference/kohya_dataset_config.json");
    for case in reference["splits"].as_array().unwrap() {
        let got = sdtrain::data::kohya_split::split_train_val(
            case["images"].as_u64().unwrap() as usize,
            case["split"].as_f64().unwrap(),
            case["seed"].as_u64().unwrap(),
        );
        let list = |k: &str| -> Vec<usize> {
            case[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect()
        };
        assert_eq!(got.train, list("train"), "{case}");
        assert_eq!(got.validation, list("validation"), "{case}");
    }
}
