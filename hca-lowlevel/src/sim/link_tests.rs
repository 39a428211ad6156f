//! Tests of the Ethernet link (in-process socket pairs): ARP both ways,
//! resolution timeout and retry, exact segmentation and AckReq placement,
//! the rxe header rules, foreign and corrupted frames, pcap output.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::link::{MIN_FRAME_LEN, roce_udp_src_port, rxe_udp_src_port};
use super::testkit::*;
use super::*;
use crate::cqe::CqeOpcode;
use crate::device::{GSI_QKEY, GSI_QPN};
use crate::wire::{
    ArpOperation, ArpRepr, EtherType, EthernetFrame, EthernetRepr, IncomingFrame, Operation,
    RoceV2FrameRepr, emit_arp_frame,
};
use crate::wqe::{CtrlFlags, DatagramSegRepr, SendOpcode};

const MAC_A: EthernetAddress = EthernetAddress([0x52, 0x54, 0x00, 0x00, 0x00, 0x0a]);
const MAC_B: EthernetAddress = EthernetAddress([0x52, 0x54, 0x00, 0x00, 0x00, 0x0b]);
const MAC_PEER: EthernetAddress = EthernetAddress([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
const IP_A: [u8; 4] = [10, 0, 0, 1];
const IP_B: [u8; 4] = [10, 0, 0, 2];

/// A socket that records what passes through it both ways.
struct Tap {
    inner: ChannelSocket,
    sent: Mutex<Vec<Vec<u8>>>,
}

impl Tap {
    fn new(inner: ChannelSocket) -> Arc<Self> {
        Arc::new(Self {
            inner,
            sent: Mutex::new(Vec::new()),
        })
    }
    fn take_sent(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut *self.sent.lock().unwrap())
    }
}

impl FrameSocket for Tap {
    fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        self.sent.lock().unwrap().push(frame.to_vec());
        self.inner.send(frame)
    }
    fn recv(&self, buf: &mut [u8], wait: Duration) -> std::io::Result<Option<usize>> {
        self.inner.recv(buf, wait)
    }
}

/// The far end of a link, played by the test.
struct Peer(ChannelSocket);

impl Peer {
    fn recv_all(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65536];
        while let Some(n) = self.0.recv(&mut buf, Duration::ZERO).unwrap() {
            out.push(buf[..n].to_vec());
        }
        out
    }
    fn send(&self, frame: &[u8]) {
        self.0.send(frame).unwrap();
    }
}

fn arp_frame(eth_dst: EthernetAddress, eth_src: EthernetAddress, arp: &ArpRepr) -> Vec<u8> {
    let mut f = vec![0u8; 42];
    emit_arp_frame(eth_src, eth_dst, arp, &mut f).unwrap();
    f
}

fn parse_arp(frame: &[u8]) -> Option<(EthernetRepr, ArpRepr)> {
    match IncomingFrame::parse(frame) {
        Ok(IncomingFrame::Arp { ethernet, arp }) => Some((ethernet, arp)),
        _ => None,
    }
}

/// Two RC nodes whose ports are linked by an in-process socket pair, with
/// taps recording what each sends.
fn linked_rc_pair(
    f: &Fabric,
    opts: RcOptions,
    pcap: Option<PathBuf>,
) -> (Node, Node, Arc<Tap>, Arc<Tap>) {
    let (sa, sb) = channel_pair();
    let (ta, tb) = (Tap::new(sa), Tap::new(sb));
    let mut la = LinkConfig::new(MAC_A);
    la.pcap = pcap;
    let a = Node::on_link(f, HcaConfig::new(IP_A), la, ta.clone(), QpType::Rc).unwrap();
    let b = Node::on_link(
        f,
        HcaConfig::new(IP_B),
        LinkConfig::new(MAC_B),
        tb.clone(),
        QpType::Rc,
    )
    .unwrap();
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), opts).unwrap();
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), opts).unwrap();
    (a, b, ta, tb)
}

/// One node on a link whose far end the test plays.
fn node_with_peer(f: &Fabric, ty: QpType, cfg: LinkConfig) -> (Node, Peer) {
    let (ours, theirs) = channel_pair();
    let n = Node::on_link(f, HcaConfig::new(IP_A), cfg, Arc::new(ours), ty).unwrap();
    (n, Peer(theirs))
}

fn roce_frames(frames: &[Vec<u8>]) -> Vec<RoceV2FrameRepr<'_>> {
    frames
        .iter()
        .filter_map(|f| RoceV2FrameRepr::parse(f).ok())
        .collect()
}

#[test]
fn arp_requests_for_our_address_are_answered_and_teach_the_sender() {
    let f = Fabric::stepped();
    let (n, peer) = node_with_peer(&f, QpType::Rc, LinkConfig::new(MAC_A));
    assert_eq!(n.hca.mac(), Some(MAC_A));
    // rxe's node GUID is the MAC's EUI-64; ours too.
    assert_eq!(n.hca.query_device().node_guid, 0x5054_00ff_fe00_000a);
    let peer_ip = Ipv4Address::new(10, 0, 0, 2);
    let who_has = ArpRepr::request(MAC_PEER, peer_ip, Ipv4Address(IP_A));
    peer.send(&arp_frame(EthernetAddress::BROADCAST, MAC_PEER, &who_has));
    // A request for someone else is not answered.
    let other = ArpRepr::request(MAC_PEER, peer_ip, Ipv4Address::new(10, 0, 0, 77));
    peer.send(&arp_frame(EthernetAddress::BROADCAST, MAC_PEER, &other));
    f.run_until_idle();

    let got = peer.recv_all();
    assert_eq!(got.len(), 1, "exactly one reply");
    assert_eq!(
        got[0].len(),
        MIN_FRAME_LEN,
        "padded to the Ethernet minimum"
    );
    let (eth, arp) = parse_arp(&got[0]).expect("an ARP frame");
    assert_eq!((eth.dst_addr, eth.src_addr), (MAC_PEER, MAC_A));
    assert_eq!(arp, who_has.reply_for(MAC_A, Ipv4Address(IP_A)).unwrap());
    assert_eq!(arp.operation, ArpOperation::Reply);

    let s = f.link_stats(&n.hca).unwrap();
    assert_eq!(
        (
            s.rx_frames,
            s.rx_arp_requests,
            s.rx_arp_other,
            s.tx_arp_replies
        ),
        (2, 1, 1, 1)
    );
    // The requester was learnt: no request of ours is needed to reach it.
    assert_eq!(f.link_neighbors(&n.hca), vec![(peer_ip, MAC_PEER)]);

    // An unsolicited reply creates no entry; one for a known address
    // updates it.
    let stranger = Ipv4Address::new(10, 0, 0, 50);
    let moved = EthernetAddress([0x52, 0x54, 0, 0, 0, 0x99]);
    for (ip, mac) in [(stranger, MAC_B), (peer_ip, moved)] {
        let reply = ArpRepr {
            operation: ArpOperation::Reply,
            source_hardware_addr: mac,
            source_protocol_addr: ip,
            target_hardware_addr: MAC_A,
            target_protocol_addr: Ipv4Address(IP_A),
        };
        peer.send(&arp_frame(MAC_A, mac, &reply));
    }
    f.run_until_idle();
    assert_eq!(f.link_neighbors(&n.hca), vec![(peer_ip, moved)]);
    assert_eq!(f.link_stats(&n.hca).unwrap().rx_arp_replies, 2);
    assert!(peer.recv_all().is_empty());
}

#[test]
fn first_frame_waits_for_arp_then_everything_flows() {
    let f = Fabric::stepped();
    let (mut a, mut b, ta, tb) = linked_rc_pair(&f, RcOptions::default(), None);
    let src = a.buffer(8192, RW).unwrap();
    let dst = b.buffer(8192, RW).unwrap();
    let data = pattern(2500, 3);
    src.mem.write(0, &data).unwrap();
    b.qp.post_recv(&[dst.sge(0, 8192)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 2500),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    let r = b.cq.drain();
    assert_eq!(
        (r.len(), r[0].opcode, r[0].byte_cnt),
        (1, CqeOpcode::RespSend, 2500)
    );
    assert_eq!(dst.bytes(0, 2500), data);

    // A's first frame was an ARP request (broadcast), then the data.
    let sent_a = ta.take_sent();
    let (eth, arp) = parse_arp(&sent_a[0]).expect("A starts with ARP");
    assert_eq!(eth.dst_addr, EthernetAddress::BROADCAST);
    assert_eq!(
        arp,
        ArpRepr::request(MAC_A, Ipv4Address(IP_A), Ipv4Address(IP_B))
    );
    // B answered and learnt A from the request: it never asks itself.
    let sent_b = tb.take_sent();
    assert!(parse_arp(&sent_b[0]).is_some_and(|(_, a)| a.operation == ArpOperation::Reply));
    assert_eq!(sent_b.iter().filter(|f| parse_arp(f).is_some()).count(), 1);
    let sa = f.link_stats(&a.hca).unwrap();
    let sb = f.link_stats(&b.hca).unwrap();
    assert_eq!((sa.tx_arp_requests, sa.rx_arp_replies), (1, 1));
    assert_eq!((sb.tx_arp_requests, sb.tx_arp_replies), (0, 1));
    // The three SEND packets waited for the reply, then left in order.
    assert_eq!(sa.tx_waited_for_arp, 3);
    let pkts = roce_frames(&sent_a);
    let ops: Vec<Operation> = pkts
        .iter()
        .map(|p| p.packet.bth.opcode.operation())
        .collect();
    assert_eq!(
        ops,
        [
            Operation::SendFirst,
            Operation::SendMiddle,
            Operation::SendLast
        ]
    );
    for (p, raw) in pkts.iter().zip(sent_a.iter().skip(1)) {
        assert_eq!((p.src_mac, p.dst_mac), (MAC_A, MAC_B));
        assert!(raw.len() <= 1514);
    }
    assert_eq!(sb.rx_delivered, 3);
    assert_eq!(
        sa.rx_delivered, 1,
        "one ACK, for the AckReq on the last packet"
    );

    // Once resolved, later traffic goes straight out.
    b.qp.post_recv(&[dst.sge(0, 8192)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 100),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    assert!(ta.take_sent().iter().all(|f| parse_arp(f).is_none()));
    assert_eq!(f.link_stats(&a.hca).unwrap().tx_arp_requests, 1);
}

#[test]
fn resolution_retries_then_gives_up_and_a_late_answer_still_connects() {
    let f = Fabric::stepped();
    let mut cfg = LinkConfig::new(MAC_A);
    cfg.arp_retry_interval = Duration::from_millis(100);
    cfg.arp_attempts = 3;
    let (mut n, peer) = node_with_peer(&f, QpType::Rc, cfg);
    let peer_ip = Ipv4Address::new(10, 0, 0, 9);
    let peer_qpn = 0x77;
    // ACK timeout 2^19 * 4.096 us = 2.1 s: no retransmission while ARP runs.
    let opts = RcOptions {
        timeout: 19,
        ..RcOptions::default()
    };
    n.bring_up(Some((Gid::from_ipv4(peer_ip), peer_qpn)), opts)
        .unwrap();
    let src = n.buffer(4096, RW).unwrap();
    let mut w = send_wqe(
        &n.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 64),
    );
    n.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let requests = |frames: Vec<Vec<u8>>| {
        frames
            .iter()
            .filter(|fr| {
                parse_arp(fr).is_some_and(|(e, a)| {
                    e.dst_addr == EthernetAddress::BROADCAST
                        && a == ArpRepr::request(MAC_A, Ipv4Address(IP_A), peer_ip)
                })
            })
            .count()
    };
    assert_eq!(requests(peer.recv_all()), 1);
    f.advance(Duration::from_millis(99));
    assert_eq!(requests(peer.recv_all()), 0, "not before the interval");
    f.advance(Duration::from_millis(1));
    assert_eq!(requests(peer.recv_all()), 1, "second attempt");
    f.advance(Duration::from_millis(100));
    assert_eq!(requests(peer.recv_all()), 1, "third attempt");
    assert_eq!(f.link_stats(&n.hca).unwrap().arp_failures, 0);
    f.advance(Duration::from_millis(100));
    let s = f.link_stats(&n.hca).unwrap();
    assert_eq!(
        (s.arp_failures, s.tx_unresolved, s.tx_arp_requests),
        (1, 1, 3)
    );
    assert!(peer.recv_all().is_empty(), "no fourth request, no data");
    assert!(n.cq.drain().is_empty(), "the SEND is still outstanding");

    // The ACK timer retransmits; that starts a new resolution, which the
    // peer now answers: the frame leaves with the right addresses.
    // (now 300 ms; the ACK timer, armed at 0, fires at 2.147 s)
    f.advance(Duration::from_millis(1850));
    assert_eq!(requests(peer.recv_all()), 1);
    let reply = ArpRepr {
        operation: ArpOperation::Reply,
        source_hardware_addr: MAC_PEER,
        source_protocol_addr: peer_ip,
        target_hardware_addr: MAC_A,
        target_protocol_addr: Ipv4Address(IP_A),
    };
    peer.send(&arp_frame(MAC_A, MAC_PEER, &reply));
    f.run_until_idle();
    let out = peer.recv_all();
    let pkts = roce_frames(&out);
    assert_eq!(pkts.len(), 1, "{out:?}");
    let p = pkts[0];
    assert_eq!((p.src_mac, p.dst_mac), (MAC_A, MAC_PEER));
    assert_eq!((p.src_ip, p.dst_ip), (Ipv4Address(IP_A), peer_ip));
    assert!(p.dont_fragment);
    assert_eq!(p.ttl, 64, "the path's hop limit");
    assert_eq!(p.udp_src_port, roce_udp_src_port(0, n.qp.qpn, peer_qpn));
    assert_eq!(&out[0][40..42], &[0, 0], "UDP checksum 0, as rxe sends");
    assert_eq!(p.packet.bth.dest_qp.get(), peer_qpn);
    assert_eq!(p.packet.bth.opcode.operation(), Operation::SendOnly);
    assert!(p.packet.bth.ack_req);
    assert_eq!(f.link_neighbors(&n.hca), vec![(peer_ip, MAC_PEER)]);
}

#[test]
fn the_wait_queue_is_bounded() {
    let f = Fabric::stepped();
    let mut cfg = LinkConfig::new(MAC_A);
    cfg.arp_queue_len = 2;
    let (mut n, peer) = node_with_peer(&f, QpType::Rc, cfg);
    n.bring_up(
        Some((Gid::from_ipv4(Ipv4Address::new(10, 0, 0, 9)), 0x77)),
        RcOptions::default(),
    )
    .unwrap();
    let src = n.buffer(8192, RW).unwrap();
    let mut w = send_wqe(
        &n.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 5000),
    );
    n.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let s = f.link_stats(&n.hca).unwrap();
    assert_eq!((s.tx_waited_for_arp, s.tx_queue_overflow), (5, 3));
    assert_eq!(peer.recv_all().len(), 1, "only the ARP request left");
}

#[test]
fn segmentation_is_exact_and_ack_requests_follow_rxe() {
    let f = Fabric::stepped();
    let (mut a, mut b, ta, tb) = linked_rc_pair(&f, RcOptions::default(), None);
    let src = a.buffer(1 << 17, RW).unwrap();
    let dst = b.buffer(1 << 17, RW).unwrap();
    // Warm up ARP both ways so the taps see only transport packets.
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    b.cq.drain();
    ta.take_sent();
    tb.take_sent();

    // A 70-packet RDMA WRITE plus one byte: 71 packets.
    let len = 70 * 1024 + 1;
    let data = pattern(len, 9);
    src.mem.write(0, &data).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        dst.iova,
        dst.keys.rkey,
        src.sge(0, len as u32),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    assert_eq!(dst.bytes(0, len), data);
    let sent = ta.take_sent();
    let pkts = roce_frames(&sent);
    assert_eq!(pkts.len(), 71);
    let first_psn = pkts[0].packet.bth.psn;
    for (k, p) in pkts.iter().enumerate() {
        let bth = p.packet.bth;
        assert_eq!(bth.psn, first_psn.wrapping_add(k as u32));
        let want = match k {
            0 => Operation::RdmaWriteFirst,
            70 => Operation::RdmaWriteLast,
            _ => Operation::RdmaWriteMiddle,
        };
        assert_eq!(bth.opcode.operation(), want);
        let n = if k == 70 { 1 } else { 1024 };
        assert_eq!(p.packet.payload.len(), n, "packet {k}");
        // rxe: AckReq on the last packet, and at least every 64 packets.
        assert_eq!(bth.ack_req, k == 63 || k == 70, "packet {k}");
    }
    assert!(sent.iter().all(|f| f.len() <= 1514));
    // B acknowledged exactly the two packets that asked for it.
    let acks = roce_frames(&tb.take_sent())
        .iter()
        .map(|p| (p.packet.bth.opcode.operation(), p.packet.bth.psn))
        .collect::<Vec<_>>();
    assert_eq!(
        acks,
        [
            (Operation::Acknowledge, first_psn.wrapping_add(63)),
            (Operation::Acknowledge, first_psn.wrapping_add(70))
        ]
    );

    // An RDMA READ of 3000 bytes: one request consumes three PSNs, the
    // responses carry them in order, FIRST/MIDDLE exactly one MTU.
    let rdata = pattern(3000, 4);
    dst.mem.write(0, &rdata).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::CQ_UPDATE,
        0,
        dst.iova,
        dst.keys.rkey,
        src.sge(0, 3000),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    assert_eq!(src.bytes(0, 3000), rdata);
    let req = roce_frames(&ta.take_sent())
        .iter()
        .map(|p| (p.packet.bth.opcode.operation(), p.packet.bth.psn))
        .collect::<Vec<_>>();
    let read_psn = first_psn.wrapping_add(71);
    assert_eq!(req, [(Operation::RdmaReadRequest, read_psn)]);
    let resp_frames = tb.take_sent();
    let resp = roce_frames(&resp_frames);
    let shape: Vec<_> = resp
        .iter()
        .map(|p| {
            (
                p.packet.bth.opcode.operation(),
                p.packet.bth.psn,
                p.packet.payload.len(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (Operation::RdmaReadResponseFirst, read_psn, 1024),
            (
                Operation::RdmaReadResponseMiddle,
                read_psn.wrapping_add(1),
                1024
            ),
            (
                Operation::RdmaReadResponseLast,
                read_psn.wrapping_add(2),
                952
            ),
        ]
    );
    // The next request continues after the READ's three PSNs.
    b.qp.post_recv(&[dst.sge(0, 64)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 8),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let next = roce_frames(&ta.take_sent())[0].packet.bth.psn;
    assert_eq!(next, read_psn.wrapping_add(3));
}

#[test]
fn a_lost_packet_gets_one_sequence_nak_and_a_retransmission() {
    // B's side of the link drops A's second packet once: B must send one
    // NAK (PSN sequence error) for it, stay silent for the rest, and A must
    // retransmit from there.
    struct DropOnce {
        inner: ChannelSocket,
        count: Mutex<u32>,
    }
    impl FrameSocket for DropOnce {
        fn send(&self, frame: &[u8]) -> std::io::Result<()> {
            self.inner.send(frame)
        }
        fn recv(&self, buf: &mut [u8], wait: Duration) -> std::io::Result<Option<usize>> {
            loop {
                let Some(n) = self.inner.recv(buf, wait)? else {
                    return Ok(None);
                };
                let mut c = self.count.lock().unwrap();
                let roce = RoceV2FrameRepr::parse(&buf[..n]).is_ok();
                if roce {
                    *c += 1;
                    if *c == 2 {
                        continue;
                    }
                }
                return Ok(Some(n));
            }
        }
    }
    let f = Fabric::stepped();
    let (sa, sb) = channel_pair();
    let ta = Tap::new(sa);
    let db = Arc::new(DropOnce {
        inner: sb,
        count: Mutex::new(0),
    });
    let mut a = Node::on_link(
        &f,
        HcaConfig::new(IP_A),
        LinkConfig::new(MAC_A),
        ta.clone(),
        QpType::Rc,
    )
    .unwrap();
    let mut b = Node::on_link(
        &f,
        HcaConfig::new(IP_B),
        LinkConfig::new(MAC_B),
        db,
        QpType::Rc,
    )
    .unwrap();
    a.bring_up(Some((b.hca.gid(), b.qp.qpn)), RcOptions::default())
        .unwrap();
    b.bring_up(Some((a.hca.gid(), a.qp.qpn)), RcOptions::default())
        .unwrap();
    let src = a.buffer(8192, RW).unwrap();
    let dst = b.buffer(8192, RW).unwrap();
    let data = pattern(4096, 1);
    src.mem.write(0, &data).unwrap();
    b.qp.post_recv(&[dst.sge(0, 8192)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::CQ_UPDATE,
        0,
        src.sge(0, 4096),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    assert_eq!(b.cq.drain().len(), 1);
    assert_eq!(dst.bytes(0, 4096), data);
    let sb = b.hca.qp_stats(b.qp.qpn).unwrap();
    assert_eq!(sb.seq_naks_sent, 1, "one NAK, then silence until ePSN");
    let sa = a.hca.qp_stats(a.qp.qpn).unwrap();
    assert_eq!((sa.seq_naks_received, sa.retransmits), (1, 1));
    // 4 packets, then the 3 from the lost one on.
    assert_eq!(roce_frames(&ta.take_sent()).len(), 7);
}

#[test]
fn gsi_datagrams_cross_the_link_as_qp1_mads() {
    let f = Fabric::stepped();
    let (sa, sb) = channel_pair();
    let ta = Tap::new(sa);
    let mut a = Node::on_link(
        &f,
        HcaConfig::new(IP_A),
        LinkConfig::new(MAC_A),
        ta.clone(),
        QpType::Gsi,
    )
    .unwrap();
    let mut b = Node::on_link(
        &f,
        HcaConfig::new(IP_B),
        LinkConfig::new(MAC_B),
        Arc::new(sb),
        QpType::Gsi,
    )
    .unwrap();
    a.bring_up(None, RcOptions::default()).unwrap();
    b.bring_up(None, RcOptions::default()).unwrap();
    let src = a.buffer(4096, RW).unwrap();
    let dst = b.buffer(4096, RW).unwrap();
    let mad = pattern(256, 5);
    src.mem.write(0, &mad).unwrap();
    b.qp.post_recv(&[dst.sge(0, 40 + 256)]).unwrap();
    let mut w = a.qp.builder(SendOpcode::Send, CtrlFlags::CQ_UPDATE, 0);
    w.datagram(&DatagramSegRepr {
        qkey: GSI_QKEY,
        dqpn: GSI_QPN,
        hop_limit: 64,
        rgid: b.hca.gid().0,
        ..DatagramSegRepr::default()
    })
    .unwrap();
    w.data(src.sge(0, 256)).unwrap();
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    assert_eq!(a.cq.drain().len(), 1);
    let r = b.cq.drain();
    assert_eq!((r.len(), r[0].byte_cnt, r[0].src_qpn), (1, 296, GSI_QPN));
    assert_eq!(dst.bytes(40, 256), mad);
    let sent = ta.take_sent();
    let p = roce_frames(&sent)[0];
    assert_eq!(p.packet.bth.opcode.to_u8(), 0x64, "UD SEND_ONLY");
    assert_eq!(p.packet.bth.dest_qp.get(), GSI_QPN);
    assert_eq!(p.packet.bth.pkey, 0xffff);
    let deth = p.packet.deth.unwrap();
    assert_eq!((deth.qkey, deth.src_qp.get()), (GSI_QKEY, GSI_QPN));
    assert_eq!(p.udp_src_port, rxe_udp_src_port(GSI_QPN));
    assert!(!p.packet.bth.ack_req, "UD never asks for an ACK");
}

/// A RoCEv2 frame from the peer to our node (for the drop tests).
fn frame_from_peer(n: &Node, peer_ip: Ipv4Address) -> Vec<u8> {
    use crate::wire::{BthRepr, IbPacketRepr, Opcode, Psn, Qpn, Transport};
    let bth = BthRepr {
        opcode: Opcode::new(Transport::Rc, Operation::SendOnly).unwrap(),
        solicited: false,
        mig_req: false,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qp: Qpn::from_low_bits(n.qp.qpn),
        ack_req: true,
        psn: Psn::from_low_bits(RcOptions::default().psn),
    };
    let payload = [0x5au8; 32];
    let frame = RoceV2FrameRepr {
        src_mac: MAC_PEER,
        dst_mac: MAC_A,
        src_ip: peer_ip,
        dst_ip: Ipv4Address(IP_A),
        tos: 0,
        ttl: 64,
        ident: 0,
        dont_fragment: true,
        udp_src_port: 0xc123,
        packet: IbPacketRepr::new(bth, &payload),
    };
    let mut buf = vec![0u8; frame.buffer_len()];
    frame.emit(&mut buf).unwrap();
    buf
}

#[test]
fn foreign_malformed_and_corrupted_frames_are_dropped_and_counted() {
    let f = Fabric::stepped();
    let (mut n, peer) = node_with_peer(&f, QpType::Rc, LinkConfig::new(MAC_A));
    let peer_ip = Ipv4Address::new(10, 0, 0, 2);
    n.bring_up(Some((Gid::from_ipv4(peer_ip), 0x33)), RcOptions::default())
        .unwrap();
    let dst = n.buffer(4096, RW).unwrap();
    n.qp.post_recv(&[dst.sge(0, 4096)]).unwrap();
    let good = frame_from_peer(&n, peer_ip);

    let mut other_mac = good.clone();
    other_mac[5] ^= 0x01;
    let mut bcast_ip = good.clone();
    bcast_ip[0..6].copy_from_slice(&[0xff; 6]);
    let mut other_ip = good.clone();
    other_ip[33] = 99;
    let mut other_port = good.clone();
    other_port[36..38].copy_from_slice(&53u16.to_be_bytes());
    let mut not_udp = good.clone();
    not_udp[23] = 6;
    let mut ipv6 = good.clone();
    ipv6[12..14].copy_from_slice(&EtherType::IPV6.0.to_be_bytes());
    let mut bad_icrc = good.clone();
    let at = bad_icrc.len() - 10;
    bad_icrc[at] ^= 0x40;
    let mut bad_ip_csum = good.clone();
    bad_ip_csum[24] ^= 0xff;
    let mut to_no_qp = good.clone();
    to_no_qp[42 + 5..42 + 8].copy_from_slice(&[0, 0x0f, 0xff]);
    // (the ICRC covers DestQP: recompute it so only the QP is wrong)
    {
        let parsed_ok = RoceV2FrameRepr::parse(&to_no_qp).is_err();
        assert!(parsed_ok);
        let ip: [u8; 20] = to_no_qp[14..34].try_into().unwrap();
        let udp: [u8; 8] = to_no_qp[34..42].try_into().unwrap();
        let end = to_no_qp.len() - 4;
        let icrc = crate::wire::icrc_ipv4(&ip, &udp, &to_no_qp[42..end]);
        to_no_qp[end..].copy_from_slice(&icrc.to_le_bytes());
    }
    let arp_garbage = {
        let mut a = arp_frame(
            EthernetAddress::BROADCAST,
            MAC_PEER,
            &ArpRepr::request(MAC_PEER, peer_ip, Ipv4Address(IP_A)),
        );
        a[14 + 7] = 9; // operation 9
        a
    };
    let inputs: Vec<Vec<u8>> = vec![
        vec![],
        vec![1, 2, 3, 4, 5],
        good[..30].to_vec(),
        other_mac,
        bcast_ip,
        other_ip,
        other_port,
        not_udp,
        ipv6,
        bad_icrc,
        bad_ip_csum,
        to_no_qp,
        arp_garbage,
        good[..good.len() - 8].to_vec(),
    ];
    let count = inputs.len() as u64;
    for i in &inputs {
        peer.send(i);
    }
    f.run_until_idle();
    assert!(n.cq.drain().is_empty(), "nothing reached the QP");
    let s = f.link_stats(&n.hca).unwrap();
    assert_eq!(s.rx_frames, count);
    assert_eq!(s.rx_foreign_mac, 2, "{s:?}");
    assert_eq!(s.rx_foreign_ip, 1, "{s:?}");
    assert_eq!(s.rx_not_roce, 2, "{s:?}");
    assert_eq!(s.rx_non_ipv4, 1, "{s:?}");
    assert_eq!(s.rx_bad_icrc, 1, "{s:?}");
    assert_eq!(s.rx_unroutable, 1, "{s:?}");
    // empty, 5 bytes, truncated IPv4, bad ARP op, bad IP checksum, cut tail
    assert_eq!(s.rx_malformed, 6, "{s:?}");
    assert_eq!(s.rx_delivered, 0);
    let outcomes = s.rx_foreign_mac
        + s.rx_foreign_ip
        + s.rx_not_roce
        + s.rx_non_ipv4
        + s.rx_bad_icrc
        + s.rx_unroutable
        + s.rx_malformed;
    assert_eq!(outcomes, count, "every frame has exactly one outcome");
    assert!(peer.recv_all().is_empty(), "nothing answered");

    // The untouched frame is accepted and acknowledged.
    peer.send(&good);
    f.run_until_idle();
    let c = n.cq.drain();
    assert_eq!(
        (c.len(), c[0].opcode, c[0].byte_cnt),
        (1, CqeOpcode::RespSend, 32)
    );
    assert_eq!(f.link_stats(&n.hca).unwrap().rx_delivered, 1);
}

#[test]
fn frames_beyond_the_ip_mtu_are_dropped_like_df_datagrams() {
    let cfg = LinkConfig::new(MAC_A);
    assert_eq!(cfg.ib_mtu(), Some(Mtu::Mtu1024));
    let jumbo = LinkConfig {
        ip_mtu: 9000,
        ..LinkConfig::new(MAC_A)
    };
    assert_eq!(jumbo.ib_mtu(), Some(Mtu::Mtu4096));
    let tiny = LinkConfig {
        ip_mtu: 300,
        ..LinkConfig::new(MAC_A)
    };
    assert_eq!(tiny.ib_mtu(), None);
    let f = Fabric::stepped();
    assert!(
        f.add_hca_on_link(HcaConfig::new(IP_B), tiny, Arc::new(channel_pair().0))
            .is_err()
    );

    // The port's active MTU follows the link...
    let (mut n, peer) = node_with_peer(&f, QpType::Rc, cfg);
    assert_eq!(n.hca.query_port(1).unwrap().active_mtu, Mtu::Mtu1024);
    // ...and a QP misconfigured with a larger path MTU loses its big packets.
    let peer_ip = Ipv4Address::new(10, 0, 0, 2);
    let opts = RcOptions {
        mtu: Mtu::Mtu2048,
        ..RcOptions::default()
    };
    n.bring_up(Some((Gid::from_ipv4(peer_ip), 0x33)), opts)
        .unwrap();
    let who_has = ArpRepr::request(MAC_PEER, peer_ip, Ipv4Address(IP_A));
    peer.send(&arp_frame(EthernetAddress::BROADCAST, MAC_PEER, &who_has));
    f.run_until_idle();
    let src = n.buffer(4096, RW).unwrap();
    let mut w = send_wqe(
        &n.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 2048),
    );
    n.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let s = f.link_stats(&n.hca).unwrap();
    assert_eq!(s.tx_oversize, 1);
    assert_eq!(s.tx_frames, 1, "only the ARP reply left");
    peer.recv_all();
}

#[test]
fn thread_mode_links_carry_traffic() {
    let f = Fabric::new(FabricConfig {
        mode: ExecMode::Thread,
        seed: 1,
        ..FabricConfig::default()
    });
    let (mut a, mut b, _ta, _tb) = linked_rc_pair(&f, RcOptions::default(), None);
    let src = a.buffer(1 << 16, RW).unwrap();
    let dst = b.buffer(1 << 16, RW).unwrap();
    let data = pattern(40_000, 8);
    src.mem.write(0, &data).unwrap();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaWrite,
        CtrlFlags::CQ_UPDATE,
        0,
        dst.iova,
        dst.keys.rkey,
        src.sge(0, 40_000),
    );
    a.qp.post_send(&mut w).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let c = loop {
        if let Some(c) = a.cq.poll() {
            break c;
        }
        assert!(std::time::Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(c.opcode, CqeOpcode::Req);
    assert_eq!(dst.bytes(0, 40_000), data);
    let _ = b.cq.drain();
    drop(f);
}

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hca-link-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn pcap_capture_holds_every_frame_and_parses() {
    let path = temp_path("link.pcap");
    let f = Fabric::stepped();
    let (mut a, mut b, ta, _tb) = linked_rc_pair(&f, RcOptions::default(), Some(path.clone()));
    let src = a.buffer(8192, RW).unwrap();
    let dst = b.buffer(8192, RW).unwrap();
    b.qp.post_recv(&[dst.sge(0, 8192)]).unwrap();
    let mut w = send_wqe(
        &a.qp,
        SendOpcode::Send,
        CtrlFlags::empty(),
        0,
        src.sge(0, 1500),
    );
    a.qp.post_send(&mut w).unwrap();
    f.run_until_idle();
    let mut w = rdma_wqe(
        &a.qp,
        SendOpcode::RdmaRead,
        CtrlFlags::empty(),
        0,
        dst.iova,
        dst.keys.rkey,
        src.sge(0, 2000),
    );
    a.qp.post_send(&mut w).unwrap();
    f.advance(Duration::from_millis(3));
    let _ = (a.cq.drain(), b.cq.drain());
    let s = f.link_stats(&a.hca).unwrap();
    let sent = ta.take_sent();

    let bytes = std::fs::read(&path).unwrap();
    let mut reader = pcap_file::pcap::PcapReader::new(&bytes[..]).unwrap();
    let header = reader.header();
    assert_eq!(header.datalink, pcap_file::DataLink::ETHERNET);
    assert_eq!(header.ts_resolution, pcap_file::TsResolution::NanoSecond);
    let mut records = Vec::new();
    while let Some(p) = reader.next_packet() {
        let p = p.unwrap();
        records.push((p.timestamp, p.data.into_owned()));
    }
    assert_eq!(records.len() as u64, s.tx_frames + s.rx_frames);
    // Every frame A sent is in the capture, in order, byte for byte.
    let captured_tx: Vec<&Vec<u8>> = records
        .iter()
        .map(|(_, d)| d)
        .filter(|d| EthernetFrame::new_checked(&d[..]).is_ok_and(|e| e.source() == MAC_A))
        .collect();
    assert_eq!(captured_tx.len(), sent.len());
    assert!(captured_tx.iter().zip(&sent).all(|(c, s)| *c == s));
    // Every record is ARP or a valid RoCEv2 frame; times never go back.
    for w in records.windows(2) {
        assert!(w[0].0 <= w[1].0);
    }
    let roce = records
        .iter()
        .filter(|(_, d)| RoceV2FrameRepr::parse(d).is_ok())
        .count();
    let arp = records
        .iter()
        .filter(|(_, d)| parse_arp(d).is_some())
        .count();
    assert_eq!(roce + arp, records.len());
    assert_eq!(arp, 2);

    tshark_decodes_as_roce(&path, roce);
}

/// `tshark -r` must see RoCE (InfiniBand over UDP) in every RoCEv2 frame.
/// Skips loudly when tshark is not installed, unless `KV_REQUIRE_TSHARK` is
/// set (CI installs it and sets that).
fn tshark_decodes_as_roce(path: &std::path::Path, roce_frames: usize) {
    let out = match std::process::Command::new("tshark")
        .arg("-r")
        .arg(path)
        .args([
            "-T",
            "fields",
            "-e",
            "frame.protocols",
            "-e",
            "infiniband.bth.opcode",
        ])
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            assert!(
                std::env::var_os("KV_REQUIRE_TSHARK").is_none(),
                "tshark required but not runnable: {e}"
            );
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "\n######## SKIPPING the tshark check of the pcap output: tshark is not \
                 installed ({e}); `apt-get install tshark` enables it ########\n"
            );
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let ib_lines = text
        .lines()
        .filter(|l| l.contains("eth:ethertype:ip:udp:infiniband"))
        .count();
    assert_eq!(ib_lines, roce_frames, "{text}");
    assert!(text.lines().any(|l| l.contains("arp")), "{text}");
    // Opcodes decoded: SEND FIRST/LAST (0, 2), READ request (12), READ
    // response FIRST/LAST (13, 15), ACK (17).
    for op in ["\t0", "\t2", "\t12", "\t13", "\t15", "\t17"] {
        assert!(
            text.lines().any(|l| l.ends_with(op)),
            "opcode {op:?} missing:\n{text}"
        );
    }
}

#[test]
fn udp_source_ports_are_rxe_s_hash_of_the_qpn() {
    // 0xC000 + (hash_32(qpn, 14) & 0x3fff), hash_32 = (v * 0x61C88647) >> 18.
    assert_eq!(rxe_udp_src_port(1), 0xd872);
    assert_eq!(rxe_udp_src_port(0x11), 0xdf94);
    assert_eq!(rxe_udp_src_port(0xff_ffff), 0xf94d);
    for q in [0u32, 1, 2, 0x10, 0x1234, 0xff_ffff] {
        assert!(rxe_udp_src_port(q) >= 0xc000);
    }
}

#[test]
fn connected_qps_take_the_udp_source_port_from_the_flow_label() {
    // Seen on the wire from Linux 6.1 rxe: QP 0x11 talking to QP 0x11.
    assert_eq!(roce_udp_src_port(0, 0x11, 0x11), 0xc121);
    // fl = (l * r) ^ high bits, then bits 14..20 folded onto 0..6.
    assert_eq!(roce_udp_src_port(0, 0x12, 0x345), 0xc000 | 0x3ada);
    assert_eq!(roce_udp_src_port(0x5_4321, 7, 9), 0xc000 | (0x0321 ^ 0x15));
    // (2^24-1)^2 = 0xff_fffe_0000_01: the high bits fold into the label.
    assert_eq!(roce_udp_src_port(0, 0xff_ffff, 0xff_ffff), 0xff21);
}
