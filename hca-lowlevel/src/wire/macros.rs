//! The boilerplate every fixed-length wire view shares.

/// Define a view struct `$name<T: AsRef<[u8]>>` over a header of `$len`
/// bytes at the start of a buffer, with `new_unchecked`, `new_checked`,
/// `check_len` and `into_inner`.
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

            /// Wrap a buffer after checking that it holds the whole header.
            ///
            /// # Errors
            ///
            #[doc = concat!("[`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than ", stringify!($len), " bytes.")]
            pub fn new_checked(buffer: T) -> super::Result<$name<T>> {
                let view = Self::new_unchecked(buffer);
                view.check_len()?;
                Ok(view)
            }

            /// Check that the buffer holds the whole header.
            ///
            /// # Errors
            ///
            /// [`Error::Truncated`](super::Error::Truncated) if it does not.
            pub fn check_len(&self) -> super::Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err(super::Error::Truncated)
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
