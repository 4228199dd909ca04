// CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with. Shared with
// build.rs, which includes this file to write the fencing-counter tag table.

/// The checksum of `bytes`.
pub(crate) const fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    let mut at = 0;
    while at < bytes.len() {
        crc ^= (bytes[at] as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        at += 1;
    }
    crc
}
