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

    srp_seeds()
    iscsi_seeds()


# --- SRP IUs, iSER + iSCSI PDUs, login/text data (storport-srp::wire) ------
# Built from the offset tables of wire-formats.md §1.2 and §2, independently
# of the Rust emitters. srp_iu inputs start with a mode byte (0: no
# immediate-data offset; 1 + 2 bytes: the offset); iscsi_text inputs start
# with a limits byte (0: negotiation, 1: SendTargets).

def port_id(id_ext, guid):
    return struct.pack(">QQ", id_ext, guid)


def direct(va, key, length):
    return struct.pack(">QII", va, key, length)


def indirect(table_va, table_key, descs):
    table = b"".join(direct(*d) for d in descs)
    total = sum(d[2] for d in descs)
    return direct(table_va, table_key, len(table)) + struct.pack(">I", total) + table


def srp_cmd(tag, lun, cdb, buf_fmt, out_cnt, in_cnt, descs, task_attr=0, sol_not=0):
    add = max(0, len(cdb) - 16)
    add = (add + 3) & ~3
    cdb = cdb + bytes(16 + add - len(cdb))
    return (bytes((0x02, sol_not, 0, 0, 0, buf_fmt, out_cnt, in_cnt)) + struct.pack(">Q", tag)
            + bytes(4) + lun + bytes((0, task_attr, 0, add)) + cdb + descs)


def srp_rsp(tag, delta, status, flags, out_res, in_res, resp, sense):
    return (bytes((0xC1, 0, 0, 0)) + struct.pack(">iQ", delta, tag) + bytes((0, 0, flags, status))
            + struct.pack(">IIII", out_res, in_res, len(sense), len(resp)) + resp + sense)


LUN0 = bytes(8)
LUN1 = bytes((0, 1)) + bytes(6)
LUN2 = bytes((0, 2)) + bytes(6)
SENSE_ILLEGAL = bytes((0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0, 0, 0, 0, 0))
READ10 = bytes((0x28, 0, 0, 0, 0x10, 0, 0, 0, 8, 0))
WRITE10 = bytes((0x2a, 0, 0, 0, 0, 0x20, 0, 0, 6, 0))
THREE_DESCS = [(0x1000, 0x11, 0x200), (0x3000, 0x12, 0x400), (0x9000, 0x13, 0x600)]


def srp_seeds():
    login_rdma = (struct.pack(">QHBBI", 0, 0x0006, 0x80, 0x00, 8260)
                  + port_id(0, 0x505400fffe123456)
                  + port_id(0x505400fffe4a0b7b, 0x505400fffe4a0b7b)
                  + struct.pack(">H", 68) + bytes(6))
    assert len(login_rdma) == 56
    login_ib = (bytes(8) + struct.pack(">Q", 0) + struct.pack(">I", 8260) + bytes(4)
                + struct.pack(">HBBHH", 0x0006, 0x80, 0, 68, 0)
                + port_id(0, 0x505400fffe123456)
                + port_id(0x505400fffe4a0b7b, 0x505400fffe4a0b7b))
    assert len(login_ib) == 64
    seeds = {
        "login_req": login_ib,
        "login_req_rdma": login_rdma,
        "login_rsp": (bytes((0xC0, 0, 0, 0)) + struct.pack(">iQIIHB", 128, 0, 8276, 8260, 6, 0x80)
                      + bytes(25)),
        "login_rej": bytes((0xC2, 0, 0, 0)) + struct.pack(">IQ", 0x00010003, 0) + bytes(8)
                     + struct.pack(">H", 6) + bytes(6),
        "i_logout": bytes((0x03,)) + bytes(7) + struct.pack(">Q", 1),
        "t_logout": bytes((0x80, 1, 0, 0)) + struct.pack(">IQ", 1, 2),
        "tsk_mgmt": (bytes((0x01, 0)) + bytes(6) + struct.pack(">Q", 0x80000000) + bytes(4) + LUN1
                     + bytes((0, 0, 0x01, 0)) + struct.pack(">Q", 5) + bytes(8)),
        "cmd_read10_direct": srp_cmd(5, LUN0, READ10, 0x01, 0, 0,
                                     direct(0x7f1234567000, 0x12345, 4096)),
        "cmd_write10_indirect": srp_cmd(5, LUN0, WRITE10, 0x20, 3, 0,
                                        indirect(0xa000, 0x99, THREE_DESCS)),
        "cmd_bidi_long_cdb": srp_cmd(5, LUN0, bytes(range(32)), 0x12, 0, 2,
                                     direct(1, 2, 3) + indirect(0xb000, 7, THREE_DESCS[:2])),
        "rsp_sense": srp_rsp(5, 1, 2, 0x02 | 0x20, 0, 512, b"", SENSE_ILLEGAL),
        "rsp_tm": srp_rsp(0x80000000, 1, 0, 0x01, 0, 0, bytes(4), b""),
        "cred_req": bytes((0x81, 0, 0, 0)) + struct.pack(">iQ", 4, 9),
        "cred_rsp": bytes((0x41,)) + bytes(7) + struct.pack(">Q", 9),
        "aer_req": (bytes((0x82, 1, 0, 0)) + struct.pack(">iQ", 1, 10) + bytes(4) + LUN2
                    + struct.pack(">I", len(SENSE_ILLEGAL)) + bytes(4) + SENSE_ILLEGAL),
        "aer_rsp": bytes((0x42,)) + bytes(7) + struct.pack(">Q", 10),
    }
    for name, iu in seeds.items():
        write("srp_iu", name, b"\x00" + iu)
    # Immediate data at the offset ib_srp uses (48 + 16 + 4 = 68).
    imm = srp_cmd(5, LUN0, WRITE10, 0x30, 0, 0, struct.pack(">I", 64))
    imm += bytes(68 - len(imm)) + b"\x5a" * 64
    write("srp_iu", "cmd_write_immediate", b"\x01" + struct.pack(">H", 68) + imm)


def iser_ctrl(write_buf=None, read_buf=None):
    flags = 0x10 | (0x08 if write_buf else 0) | (0x04 if read_buf else 0)
    ws, wv = write_buf or (0, 0)
    rs, rv = read_buf or (0, 0)
    return bytes((flags, 0, 0, 0)) + struct.pack(">IQIQ", ws, wv, rs, rv)


def bhs(b0, b1, b2=0, b3=0, ahs=b"", data=b"", lun=bytes(8), itt=0, rest=bytes(28)):
    assert len(rest) == 28 and len(ahs) % 4 == 0
    return (bytes((b0, b1, b2, b3, len(ahs) // 4)) + struct.pack(">I", len(data))[1:] + lun
            + struct.pack(">I", itt) + rest + ahs + data)


def words(*values):
    return b"".join(struct.pack(">I", v) for v in values)


LOGIN_OFFER = (b"InitiatorName=iqn.2024-01.invalid.kverbs:host\0"
               b"TargetName=iqn.2003-01.org.linux-iscsi.t1:sn.1\0SessionType=Normal\0"
               b"HeaderDigest=None\0DataDigest=None\0RDMAExtensions=Yes\0")
LOGIN_ANSWER = (b"TargetAlias=LIO Target\0TargetPortalGroupTag=1\0HeaderDigest=None\0"
                b"DataDigest=None\0RDMAExtensions=Yes\0MaxOutstandingUnexpectedPDUs=NotUnderstood\0")


def iscsi_seeds():
    isid = bytes((0x80, 0x12, 0x34, 0x56, 0, 1))
    cdb = READ10 + bytes(6)
    scsi_read = bhs(0x01, 0xC1, lun=LUN1, itt=0x12, rest=words(4096, 0x20, 0x31) + cdb)
    ecdb = struct.pack(">HB", 17, 1) + b"\xcd" * 17
    scsi_write = bhs(0x01, 0xA1, ahs=ecdb, data=b"\x5a" * 512, lun=LUN1, itt=0x12,
                     rest=words(4096, 0x20, 0x31) + cdb)
    sense = struct.pack(">H", len(SENSE_ILLEGAL)) + SENSE_ILLEGAL
    rejected = scsi_read[:48]
    seeds = {
        "login_request": iser_ctrl() + bhs(0x43, 0x87, data=LOGIN_OFFER, lun=isid + bytes(2),
                                           rest=words(0, 1, 0) + bytes(16)),
        "login_response": iser_ctrl() + bhs(0x23, 0x87, data=LOGIN_ANSWER,
                                            lun=isid + struct.pack(">H", 0x107),
                                            rest=words(0, 0x5a, 1, 64) + bytes(12)),
        "scsi_command_read": iser_ctrl(read_buf=(0x12345, 0xffff888012340000)) + scsi_read,
        "scsi_command_write_ahs_imm": iser_ctrl(write_buf=(0x99, 0x1200)) + scsi_write,
        "scsi_response_sense": iser_ctrl() + bhs(0x21, 0x82, 0, 2, data=sense, itt=0x12,
                                                 rest=words(0, 0x31, 0x21, 0x60, 0, 0, 4096)),
        "nop_in": iser_ctrl() + bhs(0x20, 0x80, itt=0xFFFFFFFF, rest=words(7, 1, 2, 3) + bytes(12)),
        "reject": iser_ctrl() + bhs(0x3F, 0x80, 0x04, data=rejected, itt=0xFFFFFFFF,
                                    rest=words(0, 1, 2, 3, 0) + bytes(8)),
        "async_logout": iser_ctrl() + bhs(0x32, 0x80, itt=0xFFFFFFFF,
                                          rest=words(0, 1, 2, 3) + bytes((1, 0))
                                          + struct.pack(">HHH", 0, 0, 10) + bytes(4)),
        "tmf_response": iser_ctrl() + bhs(0x22, 0x80, itt=9, rest=words(0, 1, 2, 3) + bytes(12)),
        "logout_response": iser_ctrl() + bhs(0x26, 0x80, itt=9,
                                             rest=words(0, 1, 2, 3, 0) + struct.pack(">HH", 2, 20)
                                             + bytes(4)),
        "hello": bytes((0x20, 0xAA)) + struct.pack(">H", 16) + bytes(8),
    }
    for name, data in seeds.items():
        write("iscsi_pdu", name, data)

    write("iscsi_text", "login_offer", b"\x00" + LOGIN_OFFER)
    write("iscsi_text", "login_answer", b"\x00" + LOGIN_ANSWER)
    write("iscsi_text", "send_targets",
          b"\x01TargetName=iqn.a\0TargetAddress=10.0.0.1:3260,1\0TargetAddress=10.0.0.2:3260,1\0"
          b"TargetName=iqn.b\0TargetAddress=10.0.0.1:3260,1\0")
    write("iscsi_text", "chap",
          b"\x00AuthMethod=CHAP,None\0CHAP_A=5\0CHAP_I=1\0"
          b"CHAP_C=0x0123456789abcdef0123456789abcdef\0")


if __name__ == "__main__":
    main()
