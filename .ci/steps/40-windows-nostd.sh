# The no_std core crates must build for the Windows kernel target.
cargo build --target x86_64-pc-windows-msvc --no-default-features \
    -p hca-lowlevel -p kverbs -p storport-srp
