//! JSON has no NaN or infinity, so the protocol sends non-finite floats as the strings
//! `"NaN"`, `"Infinity"` and `"-Infinity"`. [`Float`] reads either form and writes
//! finite values as numbers and the rest as those strings.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A float as it travels on the wire: finite values are JSON numbers, non-finite ones
/// the strings `"NaN"`, `"Infinity"` and `"-Infinity"` (exactly these spellings).
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default)]
pub struct Float(pub f64);

impl Float {
    pub fn get(self) -> f64 {
        self.0
    }

    pub fn is_finite(self) -> bool {
        self.0.is_finite()
    }
}

impl From<f64> for Float {
    fn from(value: f64) -> Self {
        Float(value)
    }
}

impl From<Float> for f64 {
    fn from(value: Float) -> Self {
        value.0
    }
}

/// The wire spelling of a non-finite value, or `None` for a finite one.
pub fn non_finite_spelling(value: f64) -> Option<&'static str> {
    if value.is_nan() {
        Some("NaN")
    } else if value == f64::INFINITY {
        Some("Infinity")
    } else if value == f64::NEG_INFINITY {
        Some("-Infinity")
    } else {
        None
    }
}

impl Serialize for Float {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match non_finite_spelling(self.0) {
            Some(spelling) => serializer.serialize_str(spelling),
            None => serializer.serialize_f64(self.0),
        }
    }
}

struct FloatVisitor;

impl Visitor<'_> for FloatVisitor {
    type Value = Float;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(r#"a number, or one of the strings "NaN", "Infinity", "-Infinity""#)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Float, E> {
        Ok(Float(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Float, E> {
        Ok(Float(v as f64))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Float, E> {
        Ok(Float(v as f64))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Float, E> {
        match v {
            "NaN" => Ok(Float(f64::NAN)),
            "Infinity" => Ok(Float(f64::INFINITY)),
            "-Infinity" => Ok(Float(f64::NEG_INFINITY)),
            other => Err(E::custom(format_args!(
                r#"unknown non-finite spelling {other:?}: use "NaN", "Infinity" or "-Infinity""#
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FloatVisitor)
    }
}

/// In the API document: a JSON number, or one of the three non-finite spellings.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Float {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::Number))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(["NaN", "Infinity", "-Infinity"])),
            )
            .description(Some(
                "A number; JSON has no NaN or infinity, so those are the strings \"NaN\", \"Infinity\", \"-Infinity\"",
            ))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Float {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_round_trip_as_strings() {
        for (value, text) in [
            (f64::INFINITY, r#""Infinity""#),
            (f64::NEG_INFINITY, r#""-Infinity""#),
            (1.5, "1.5"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(serde_json::to_string(&Float(value)).unwrap(), text);
            let back: Float = serde_json::from_str(text).unwrap();
            assert_eq!(back.0.to_bits(), value.to_bits());
        }
        let nan = serde_json::to_string(&Float(f64::NAN)).unwrap();
        assert_eq!(nan, r#""NaN""#);
        assert!(serde_json::from_str::<Float>(&nan).unwrap().0.is_nan());
    }

    #[test]
    fn integers_are_floats_too() {
        assert_eq!(serde_json::from_str::<Float>("3").unwrap(), Float(3.0));
        assert_eq!(serde_json::from_str::<Float>("-3").unwrap(), Float(-3.0));
    }

    #[test]
    fn other_spellings_are_rejected_with_the_accepted_ones_named() {
        for text in [r#""nan""#, r#""inf""#, r#""+Infinity""#, r#""1.0""#] {
            let err = serde_json::from_str::<Float>(text).unwrap_err().to_string();
            assert!(
                err.contains("\"NaN\", \"Infinity\" or \"-Infinity\""),
                "{err}"
            );
        }
        assert!(serde_json::from_str::<Float>("true").is_err());
    }
}
