//! kohya's bucket keys (`min_bucket_reso`, `max_bucket_reso`, `bucket_reso_steps`, in train.json
//! or a dataset config) against kohya's `make_bucket_resolutions`
//! (tests/fixtures/kohya_dataset_config_reference.py, run on kohya's own function).

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
