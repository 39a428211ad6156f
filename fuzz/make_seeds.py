#!/usr/bin/env python3
"""Write the seed corpus of the fuzz targets (fuzz/corpus/<target>/*.bin).

The seeds are the golden frames of wire-formats.md and hand-built packets
of the other shapes. Frames get their ICRC from zlib's CRC-32 (as
wire-formats.md §3.4 describes it), an implementation independent of the
Rust one; the targets then check that every seed parses and round-trips.
Run from anywhere: python3 fuzz/make_seeds.py
"""
import os
import struct
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".bin"), "wb") as f:
        f.write(bytes(data))


def bth(opcode, qpn, psn, pad=0, ack_req=False, pkey=0xFFFF):
    return (struct.pack(">BBH", opcode, pad << 4, pkey)
            + struct.pack(">I", qpn & 0xFFFFFF)
            + struct.pack(">I", (0x80000000 if ack_req else 0) | (psn & 0xFFFFFF)))


def padded(payload):
    pad = (-len(payload)) % 4
    return pad, bytes(payload) + bytes(pad)


def ib(opcode, qpn, psn, headers=b"", payload=b"", ack_req=False):
    pad, body = padded(payload)
    return bth(opcode, qpn, psn, pad, ack_req) + headers + body


def reth(va, rkey, length):
    return struct.pack(">QII", va, rkey, length)


def aeth(syndrome, msn):
    return struct.pack(">I", (syndrome << 24) | (msn & 0xFFFFFF))


def deth(qkey, src_qp):
    return struct.pack(">II", qkey, src_qp & 0xFFFFFF)


def ipv4_checksum(header):
    s = sum(struct.unpack(">10H", header))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


def roce_frame(ib_packet, src_ip=(192, 0, 2, 1), dst_ip=(192, 0, 2, 2),
               src_mac=b"\x02\x00\x00\x00\x00\x01",
               dst_mac=b"\x52\x54\x00\x12\x34\x56", ident=1, sport=0xC000):
    udp_len = 8 + len(ib_packet) + 4
    ip = bytearray(struct.pack(">BBHHHBBH4B4B", 0x45, 0, 20 + udp_len, ident,
                               0x4000, 64, 17, 0, *src_ip, *dst_ip))
    ip[10:12] = struct.pack(">H", ipv4_checksum(bytes(ip)))
    udp = struct.pack(">HHHH", sport, 4791, udp_len, 0)
    masked_ip = bytearray(ip)
    masked_ip[1] = 0xFF
    masked_ip[8] = 0xFF
    masked_ip[10:12] = b"\xff\xff"
    masked_udp = udp[:6] + b"\xff\xff"
    masked_ib = bytearray(ib_packet)
    masked_ib[4] = 0xFF
    crc = zlib.crc32(b"\xff" * 8 + bytes(masked_ip) + masked_udp + bytes(masked_ib))
    return (dst_mac + src_mac + b"\x08\x00" + bytes(ip) + udp + ib_packet
            + struct.pack("<I", crc))


def cm_mad(attribute, body_fields, tid=0x000000012A3B4C5D):
    m = bytearray(256)
    m[0:24] = struct.pack(">BBBBHHQHHI", 1, 7, 2, 3, 0, 0, tid, attribute, 0, 0)
    for offset, data in body_fields:
        m[24 + offset:24 + offset + len(data)] = data
    return bytes(m)


MAPPED = lambda a: bytes(10) + b"\xff\xff" + bytes(a)
CMA_HDR = b"\x00\x40\xc3\x50" + bytes(12) + bytes((192, 0, 2, 1)) + bytes(12) + bytes((192, 0, 2, 2))

REQ = cm_mad(0x10, [
    (0, bytes.fromhex("1a2b3c4d")),
    (8, bytes.fromhex("00000000010615b3")),
    (16, bytes.fromhex("000000fffe000001")),
    (32, bytes.fromhex("00001104")),
    (36, bytes.fromhex("00000004")),
    (40, bytes.fromhex("000000a1")),
    (44, bytes.fromhex("123456a7")),
    (48, bytes.fromhex("ffff37f0")),
    (52, bytes.fromhex("ffffffff")),
    (56, MAPPED((192, 0, 2, 1))),
    (72, MAPPED((192, 0, 2, 2))),
    (88, bytes.fromhex("12345007")),
    (92, bytes.fromhex("00400090")),
    (140, CMA_HDR),
    (176, bytes.fromhex("0000000000000000" "0006" "80" "00" "00001000")
     + bytes(8) + bytes.fromhex("0000ffffc0000201")
     + bytes.fromhex("505400fffe123456") * 2 + bytes.fromhex("0044") + bytes(6)),
])
REP = cm_mad(0x13, [
    (0, bytes.fromhex("5e6f7a8b1a2b3c4d")),
    (12, bytes.fromhex("00002200")),
    (20, bytes.fromhex("65432100")),
    (24, bytes.fromhex("04047be0")),
    (28, bytes.fromhex("505400fffe123456")),
    (36, bytes.fromhex("c0000000000000800000000000000000000020540000100000068000")),
])
RTU = cm_mad(0x14, [(0, bytes.fromhex("1a2b3c4d5e6f7a8b"))])
REJ = cm_mad(0x12, [
    (0, bytes.fromhex("5e6f7a8b1a2b3c4d")),
    (8, bytes.fromhex("0000001c")),
    (84, bytes.fromhex("c200000000010003") + bytes(16) + bytes.fromhex("0006") + bytes(6)),
])
MRA = cm_mad(0x11, [(0, bytes.fromhex("5e6f7a8b1a2b3c4d")), (8, bytes.fromhex("40a8"))])
DREQ = cm_mad(0x15, [(0, bytes.fromhex("1a2b3c4d5e6f7a8b")), (8, bytes.fromhex("000022"))])
DREP = cm_mad(0x16, [(0, bytes.fromhex("5e6f7a8b1a2b3c4d"))])
REJ_ARI = cm_mad(0x12, [
    (0, bytes.fromhex("000000001a2b3c4d")),
    (8, bytes.fromhex("4020000c")),
    (12, bytes(range(16))),
])

GOLDEN_FRAME = bytes.fromhex(
    "525400123456020000000001080045000038000140004011b6b0c0000201c0000202c00012b7"
    "002400000410ffff000000118000010068656c6c6f2c20727865210044e0985d")


def main():
    send_only = ib(0x04, 0x11, 256, payload=b"hello, rxe!", ack_req=True)
    ud_req = ib(0x64, 1, 0, deth(0x80010000, 1), REQ)
    ib_seeds = {
        "rc_send_only": send_only,
        "rc_ack": ib(0x11, 0x11, 256, aeth(0x1F, 5)),
        "rc_rnr_nak": ib(0x11, 0x11, 257, aeth(0x2E, 5)),
        "rc_nak_psn_seq": ib(0x11, 0x11, 250, aeth(0x60, 4)),
        "rc_write_only_zero_len": ib(0x0A, 0x11, 300, reth(0, 0, 0), ack_req=True),
        "rc_write_only_imm": ib(0x0B, 0x11, 301, reth(0x7F0000001000, 0x1234, 5)
                                + struct.pack(">I", 0xCAFE), b"abcde", True),
        "rc_read_request": ib(0x0C, 0x22, 512, reth(0x7F0000002000, 0x5678, 4096), ack_req=True),
        "rc_read_response_only": ib(0x10, 0x11, 512, aeth(0x1F, 7), bytes(range(16))),
        "rc_send_last_inv": ib(0x16, 0x11, 600, struct.pack(">I", 0x4242), b"xyz", True),
        "rc_compare_swap": ib(0x13, 0x11, 700, struct.pack(">QIQQ", 0x1000, 9, 1, 2), ack_req=True),
        "rc_atomic_ack": ib(0x12, 0x11, 700, aeth(0x1F, 8) + struct.pack(">Q", 77)),
        "rc_flush": ib(0x1C, 0x11, 800, struct.pack(">I", 0x13) + reth(0x1000, 1, 64)),
        "rc_atomic_write": ib(0x1D, 0x11, 801, reth(0x1000, 1, 8), bytes(8)),
        "rd_send_only": ib(0x44, 0x11, 5, struct.pack(">I", 3) + deth(0x1111, 9), b"rd!!"),
        "ud_send_only_cm_req": ud_req,
    }
    for name, data in ib_seeds.items():
        write("ib_packet", name, data)

    arp_request = (b"\xff" * 6 + b"\x52\x54\x00\x12\x34\x56" + b"\x08\x06"
                   + struct.pack(">HHBBH", 1, 0x0800, 6, 4, 1)
                   + b"\x52\x54\x00\x12\x34\x56" + bytes((192, 0, 2, 2))
                   + bytes(6) + bytes((192, 0, 2, 1)))
    frame_seeds = {
        "golden_send_only": GOLDEN_FRAME,
        "arp_request_padded": arp_request + bytes(60 - len(arp_request)),
        "ud_cm_req": roce_frame(ud_req, ident=2),
        "rc_ack": roce_frame(ib_seeds["rc_ack"], (192, 0, 2, 2), (192, 0, 2, 1),
                             b"\x52\x54\x00\x12\x34\x56", b"\x02\x00\x00\x00\x00\x01", 9),
        "rc_read_response": roce_frame(ib_seeds["rc_read_response_only"], ident=3),
    }
    assert roce_frame(send_only) == GOLDEN_FRAME, "zlib ICRC reproduces the golden frame"
    for name, data in frame_seeds.items():
        write("roce_frame", name, data)

    for name, data in {"req": REQ, "rep": REP, "rtu": RTU, "rej_consumer": REJ, "mra": MRA,
                       "dreq": DREQ, "drep": DREP, "rej_with_ari": REJ_ARI,
                       "cma_header": CMA_HDR}.items():
        write("cm_mad", name, data)


if __name__ == "__main__":
    main()
