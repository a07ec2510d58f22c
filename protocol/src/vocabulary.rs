//! Closed vocabularies (alert kinds, series kinds, error codes, wiring findings), each
//! declared once as a table by [`vocabulary!`](crate::vocabulary!): one row a
//! variant with its wire name (and, where the table has one, its properties). The
//! enum, its list, its names, its parsing and its serde form all come from that one
//! row, so a name cannot be added in one place and forgotten in another.

use std::fmt;
use std::marker::PhantomData;

/// What [`vocabulary!`](crate::vocabulary!) gives every table it declares.
pub trait Vocabulary: Copy + 'static {
    /// Every wire name, in the table's order.
    const NAMES: &'static [&'static str];
    /// The variant of this wire name.
    fn parse(text: &str) -> Option<Self>;
}

/// Reads a vocabulary's variant from its wire name; any other string is refused
/// with the list of names, as serde's derive words it.
pub struct NameVisitor<T>(PhantomData<T>);

impl<T> NameVisitor<T> {
    pub const fn new() -> Self {
        NameVisitor(PhantomData)
    }
}

impl<T> Default for NameVisitor<T> {
    fn default() -> Self {
        NameVisitor::new()
    }
}

impl<T: Vocabulary> serde::de::Visitor<'_> for NameVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "one of {}", T::NAMES.join(", "))
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<T, E> {
        T::parse(text).ok_or_else(|| E::unknown_variant(text, T::NAMES))
    }
}

/// The OpenAPI schema of a vocabulary: a string, one of its names.
#[cfg(feature = "openapi")]
pub fn names_schema<T: Vocabulary>() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(T::NAMES.iter().copied()))
        .into()
}

/// Declares a closed vocabulary as one table:
///
/// ```
/// gradflow_protocol::vocabulary! {
///     /// How a thing is.
///     pub enum Shape {
///         /// Round.
///         Round = "round",
///         Square = "square",
///     }
/// }
/// assert_eq!(Shape::ALL, [Shape::Round, Shape::Square]);
/// assert_eq!(Shape::parse("square"), Some(Shape::Square));
/// assert_eq!(serde_json::to_string(&Shape::Round).unwrap(), "\"round\"");
/// ```
///
/// A name may be any constant expression (`Other::Kind.as_str()` borrows another
/// table's). With a property type after the name (`pub enum Code: Status { A = "a"
/// => Status::Bad, … }`), each row also carries its value of it, read by
/// `properties()`. The enum gets `ALL`, `NAMES`, `as_str`, `parse`, `Display` and
/// serde's `Serialize`/`Deserialize` as its names; declaration order is the table's,
/// so `variant as usize` indexes `ALL`.
#[macro_export]
macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $properties:ty {
            $( $(#[$vmeta:meta])* $variant:ident = $text:expr => $value:expr ),+ $(,)?
        }
    ) => {
        $crate::vocabulary! {
            $(#[$meta])*
            $vis enum $name {
                $( $(#[$vmeta])* $variant = $text ),+
            }
        }

        impl $name {
            /// This row's properties in the table.
            pub const fn properties(self) -> $properties {
                match self {
                    $( $name::$variant => $value ),+
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:expr ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// How many rows the table has.
            pub const COUNT: usize = [$(stringify!($variant)),+].len();
            /// Every variant, in the table's order.
            pub const ALL: [$name; $name::COUNT] = [$($name::$variant),+];
            /// Every wire name, in the table's order.
            pub const NAMES: [&'static str; $name::COUNT] = [$($text),+];

            /// The wire name.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text ),+
                }
            }

            /// The variant of a wire name.
            pub fn parse(text: &str) -> ::core::option::Option<$name> {
                $name::ALL.into_iter().find(|v| v.as_str() == text)
            }

            /// Every wire name, comma-separated, for error texts.
            pub fn names() -> ::std::string::String {
                $name::NAMES.join(", ")
            }
        }

        impl $crate::vocabulary::Vocabulary for $name {
            const NAMES: &'static [&'static str] = &$name::NAMES;

            fn parse(text: &str) -> ::core::option::Option<$name> {
                $name::parse(text)
            }
        }

        impl ::core::fmt::Display for $name {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::__serde::Serialize for $name {
            fn serialize<S: $crate::__serde::Serializer>(
                &self,
                serializer: S,
            ) -> ::core::result::Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> $crate::__serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::__serde::Deserializer<'de>>(
                deserializer: D,
            ) -> ::core::result::Result<$name, D::Error> {
                deserializer.deserialize_str($crate::vocabulary::NameVisitor::<$name>::new())
            }
        }
    };
}

/// Implements utoipa's `ToSchema` for a vocabulary as [`names_schema`]: the API
/// document's enum is the table's names. Needs the `openapi` feature.
#[macro_export]
macro_rules! vocabulary_schema {
    ($name:ty) => {
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                $crate::vocabulary::names_schema::<$name>()
            }
        }

        impl utoipa::ToSchema for $name {}
    };
}

#[cfg(test)]
mod tests {
    crate::vocabulary! {
        /// A test table.
        enum Shape: u8 {
            Round = "round" => 1,
            Square = "square" => 4,
        }
    }

    #[test]
    fn one_row_gives_the_list_the_names_the_parse_and_serde() {
        assert_eq!(Shape::ALL, [Shape::Round, Shape::Square]);
        assert_eq!(Shape::NAMES, ["round", "square"]);
        assert_eq!(Shape::names(), "round, square");
        assert_eq!(Shape::Square.properties(), 4);
        for shape in Shape::ALL {
            assert_eq!(Shape::parse(shape.as_str()), Some(shape));
            let json = serde_json::to_value(shape).unwrap();
            assert_eq!(json, shape.as_str());
            assert_eq!(serde_json::from_value::<Shape>(json).unwrap(), shape);
        }
        let error = serde_json::from_str::<Shape>("\"oval\"").unwrap_err();
        assert!(
            error.to_string().contains("unknown variant `oval`"),
            "{error}"
        );
        assert!(error.to_string().contains("`round` or `square`"), "{error}");
        // CBOR reads the same names.
        let cbor = crate::to_cbor(&Shape::Square);
        assert_eq!(
            ciborium::from_reader::<Shape, _>(&cbor[..]).unwrap(),
            Shape::Square
        );
    }
}
