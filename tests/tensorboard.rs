//! TensorBoard event files: the bytes PyTorch's `SummaryWriter` writes (a golden file made by
//! `tests/fixtures/tensorboard/make_pytorch_events.py`).

mod common;

use std::path::PathBuf;

use sdtrain::tensorboard::event::{Event, ValueData, What, FILE_VERSION};
use sdtrain::tensorboard::reader::{read_file, scalars};
use sdtrain::tensorboard::record::{frame, parse_records};

fn golden() -> PathBuf {
    common::fixture("tensorboard/pytorch.tfevents")
}

/// Reads the golden file with our reader and checks what the generator wrote. Catches a wrong
/// field number or wire type in the reader, a wrong CRC or mask.
#[test]
fn pytorch_event_file_reads_back() {
    let events = read_file(&golden()).unwrap();
    assert_eq!(events[0].what, What::FileVersion(FILE_VERSION.into()));
    assert!(events.iter().all(|e| e.wall_time > 1.7e9), "{events:?}");
    assert_eq!(scalars(&events, "loss"), [(1, 0.25)]);
    assert_eq!(scalars(&events, "lr/unet"), [(1, 0.0)]);
    assert_eq!(scalars(&events, "grad_norm"), [(2, 3.5)]);
    assert_eq!(scalars(&events, "memory/in_use_mib"), [(300, 1234.5)]);
    let image = events
        .iter()
        .find_map(|e| match &e.what {
            What::Summary(v) if v[0].tag == "samples/0" => Some((e.step, v[0].data.clone())),
            _ => None,
        })
        .expect("the image event");
    let (2, ValueData::Image(img)) = image else {
        panic!("{image:?}")
    };
    assert_eq!((img.width, img.height, img.colorspace), (3, 2, 3));
    let rgb = image::load_from_memory(&img.encoded).unwrap().to_rgb8();
    assert_eq!(rgb.dimensions(), (3, 2));
    assert_eq!(rgb.get_pixel(0, 0).0, [255, 0, 0]);
    assert_eq!(rgb.get_pixel(2, 1).0, [128, 128, 128]);
}

/// Each event of the golden file, encoded and framed by sdtrain, gives PyTorch's bytes exactly:
/// field numbers, wire types, proto3's left-out defaults (step 0) and kept oneof zeros
/// (`lr/unet` 0.0), multi-byte varints (step 300), and the framing. A round trip through our
/// own reader cannot catch a field number that is wrong both ways; this can.
#[test]
fn our_encoding_of_pytorch_events_is_byte_identical() {
    let bytes = std::fs::read(golden()).unwrap();
    let (records, err) = parse_records(&bytes);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(records.len(), 6);
    let mut ours = Vec::new();
    for r in &records {
        let event = Event::decode(&r.data).unwrap();
        assert_eq!(event.encode(), r.data, "{event:?}");
        ours.extend(frame(&event.encode()));
    }
    assert_eq!(ours, bytes);
}
