//! The boilerplate every fixed-length wire view shares.

/// Define a view struct `$name<T: AsRef<[u8]>>` over `$len` bytes at the
/// start of a buffer, with `new_unchecked`, `new_checked`, `check_len` and
/// `into_inner`.
macro_rules! fixed_view {
    ($(#[$meta:meta])* $name:ident, $len:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wrap a buffer without checking its length (for emitting into a
            /// buffer sized with the representation's `buffer_len`).
            pub const fn new_unchecked(buffer: T) -> $name<T> {
                $name { buffer }
            }

            /// Wrap a buffer after checking its length.
            ///
            /// # Errors
            ///
            #[doc = concat!("[`Error::Truncated`](crate::wire::Error::Truncated) if the buffer is shorter than ", stringify!($len), " bytes.")]
            pub fn new_checked(buffer: T) -> crate::wire::Result<$name<T>> {
                let view = Self::new_unchecked(buffer);
                view.check_len()?;
                Ok(view)
            }

            /// Check the buffer is long enough.
            ///
            /// # Errors
            ///
            /// [`Error::Truncated`](crate::wire::Error::Truncated) if it is not.
            pub fn check_len(&self) -> crate::wire::Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err(crate::wire::Error::Truncated)
                } else {
                    Ok(())
                }
            }

            /// The underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

/// Private-data accessors for a CM message view whose private data occupies
/// `$field` (a `Field` constant of the message's `field` module).
macro_rules! private_data_accessors {
    ($name:ident, $field:expr) => {
        impl<'a, T: AsRef<[u8]> + ?Sized> $name<&'a T> {
            /// The whole private-data field (its length is fixed; consumers
            /// that sent less see zero padding).
            pub fn private_data(&self) -> &'a [u8] {
                bytes::slice(self.buffer.as_ref(), $field)
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            /// Copy `data` to the start of the private-data field and zero the rest.
            ///
            /// # Errors
            ///
            /// [`Error::PrivateDataTooLong`](crate::wire::Error::PrivateDataTooLong)
            /// when `data` is longer than the field.
            pub fn set_private_data(&mut self, data: &[u8]) -> crate::wire::Result<()> {
                let field = bytes::slice_mut(self.buffer.as_mut(), $field);
                let (head, tail) = field
                    .split_at_mut_checked(data.len())
                    .ok_or(crate::wire::Error::PrivateDataTooLong($field.len()))?;
                head.copy_from_slice(data);
                tail.fill(0);
                Ok(())
            }
        }
    };
}
