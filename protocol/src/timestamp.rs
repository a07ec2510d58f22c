//! Timestamps arrive as RFC 3339 strings or as Unix seconds (a JSON number, possibly
//! fractional). Both become a [`Timestamp`]; it is always written back as RFC 3339.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A point in time, held as Unix seconds with sub-second precision.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Timestamp(f64);

/// The range a timestamp may take: years 1970 through 9999, which RFC 3339 can spell.
const MAX_UNIX_SECONDS: f64 = 253_402_300_799.0;

impl Timestamp {
    /// Unix seconds in `[0, 253402300799]` (1970-01-01 through 9999-12-31).
    pub fn from_unix_seconds(seconds: f64) -> Result<Self, String> {
        if !seconds.is_finite() || !(0.0..=MAX_UNIX_SECONDS).contains(&seconds) {
            return Err(format!(
                "timestamp {seconds} is out of range: Unix seconds must lie between 0 and {MAX_UNIX_SECONDS}"
            ));
        }
        Ok(Timestamp(seconds))
    }

    pub fn parse_rfc3339(text: &str) -> Result<Self, String> {
        let parsed = OffsetDateTime::parse(text, &Rfc3339)
            .map_err(|e| format!("invalid RFC 3339 timestamp {text:?}: {e}"))?;
        let seconds = parsed.unix_timestamp_nanos() as f64 / 1e9;
        Self::from_unix_seconds(seconds)
    }

    pub fn now() -> Self {
        Timestamp(OffsetDateTime::now_utc().unix_timestamp_nanos() as f64 / 1e9)
    }

    pub fn unix_seconds(self) -> f64 {
        self.0
    }

    /// RFC 3339 in UTC with millisecond precision, e.g. `2026-11-21T10:00:12.345Z`.
    pub fn to_rfc3339(self) -> String {
        let millis = (self.0 * 1000.0).round() as i128;
        let datetime = OffsetDateTime::from_unix_timestamp_nanos(millis * 1_000_000)
            .expect("timestamps are range-checked on construction");
        datetime
            .format(&Rfc3339)
            .expect("years 1970..=9999 always format")
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_rfc3339())
    }
}

struct TimestampVisitor;

impl Visitor<'_> for TimestampVisitor {
    type Value = Timestamp;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an RFC 3339 string or Unix seconds as a number")
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Timestamp, E> {
        Timestamp::from_unix_seconds(v).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Timestamp, E> {
        Timestamp::from_unix_seconds(v as f64).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Timestamp, E> {
        Timestamp::from_unix_seconds(v as f64).map_err(E::custom)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Timestamp, E> {
        Timestamp::parse_rfc3339(v).map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TimestampVisitor)
    }
}

/// In the API document: an RFC 3339 string, or Unix seconds.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{
            KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, Type,
        };
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
            )
            .item(ObjectBuilder::new().schema_type(Type::Number))
            .description(Some("An RFC 3339 timestamp, or Unix seconds"))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Timestamp {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_and_unix_seconds_name_the_same_instant() {
        let a: Timestamp = serde_json::from_str(r#""2026-11-21T10:00:12.345Z""#).unwrap();
        let b: Timestamp = serde_json::from_str("1795255212.345").unwrap();
        assert!((a.unix_seconds() - b.unix_seconds()).abs() < 1e-6);
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#""2026-11-21T10:00:12.345Z""#
        );
    }

    #[test]
    fn offsets_are_normalised_to_utc() {
        let t: Timestamp = serde_json::from_str(r#""2026-11-21T12:00:00+02:00""#).unwrap();
        assert_eq!(t.to_rfc3339(), "2026-11-21T10:00:00Z");
    }

    #[test]
    fn malformed_and_out_of_range_times_are_rejected() {
        for text in [
            r#""yesterday""#,
            r#""2026-13-01T00:00:00Z""#,
            "-5",
            "1e20",
            "true",
        ] {
            assert!(serde_json::from_str::<Timestamp>(text).is_err(), "{text}");
        }
    }
}
