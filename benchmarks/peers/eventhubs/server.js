'use strict';
/*
 * An Event Hubs AMQP 1.0 test peer on rhea: plain AMQP on 127.0.0.1, SASL ANONYMOUS/PLAIN, CBS
 * put-token on $cbs, $management READ, and sender links to the hub whose batch transfers
 * (message-format 0x80013700) it decodes into one stored event per Data section.
 * With --tls-cert/--tls-key it also listens as the service does: AMQPS (AMQP over TLS, the
 * service's 5671) and AMQP over secure WebSocket (the service's 443: path /$servicebus/websocket,
 * subprotocol AMQPWSB10), each on its own ephemeral port.
 *
 * A small HTTP control port (127.0.0.1) lets tests read what arrived and inject faults:
 *   GET  /events            every stored event (JSON list)
 *   GET  /stats             counters (connections, transfers, cbs, mgmt, ...)
 *   POST /faults            JSON: {cbs_status, link_error, reject, delay_ms, count...} (see setFaults)
 *   POST /reset             forget events and counters, clear faults
 *   POST /down | /up        stop / resume listening for AMQP (open connections are dropped)
 *   POST /disconnect        JSON {how, condition, description}: what the service does to idle clients,
 *                           now: "close" (connection close with an error), "detach" (hub links
 *                           closed with an error), "drop" (TCP reset, no AMQP goodbye) or
 *                           "freeze" (nothing read or answered any more: a forgotten NAT flow)
 * Faults "on_transfer" (same "how" values) do the same when a hub transfer arrives, before it is
 * stored ("lose": the batch is lost in flight) or after ("keep": stored but never settled).
 * On start it prints one JSON line: {"amqp_port": N, "amqps_port": N|null, "wss_port": N|null,
 * "control_port": M}.
 *
 * The SDK under test (azure-eventhub's pure-Python AMQP decoder) reads performative fields by
 * position, so every composite this peer writes is sent at full length (trailing nulls kept):
 * rhea's composite writer is wrapped before rhea loads. That changes the peer, never the SDK.
 */

const types = require('rhea/lib/types.js');

// An absent field is written as its declared default (the same meaning), or as an explicit null.
function defaultOf(field) {
    let dv = field.default_value;
    if (dv === undefined || field.multiple) return types.Null();
    if (typeof dv === 'string' && /^[0-9]+$/.test(dv) && field.type !== 'string' && field.type !== 'symbol') dv = Number(dv);
    const wrap = types['wrap_' + field.type];
    return wrap ? wrap(dv) : types.Null();
}

function fullLength(c, def) {
    const n = def.fields.length;
    c.prototype.described = function () {
        const v = this.value.slice();
        for (let i = 0; i < n; i++) {
            if (v[i] === undefined || v[i] === null) v[i] = defaultOf(def.fields[i]);
        }
        return types.described_nc(types.wrap_ulong(c.descriptor.numeric), types.wrap_list(v));
    };
    return c;
}

const defineComposite = types.define_composite;
types.define_composite = function (def) {
    return fullLength(defineComposite(def), def);
};
// The error composite was defined while types.js loaded: rebuild its wrapper the same way.
const ErrorComposite = types.define_composite({
    name: 'error',
    code: 0x1d,
    fields: [
        { name: 'condition', type: 'symbol', mandatory: true },
        { name: 'description', type: 'string' },
        { name: 'info', type: 'map' },
    ],
});
types.wrap_error = function (fields) {
    return ErrorComposite.create(fields).described();
};

const rhea = require('rhea');
const fs = require('fs');
const http = require('http');
const https = require('https');
const net = require('net');
const { WebSocketServer } = require('ws');

const BATCH_FORMAT = 0x80013700;

function arg(name, fallback) {
    const i = process.argv.indexOf('--' + name);
    return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

const HOST = '127.0.0.1';
const HUB = arg('hub', 'hub1');
const PARTITIONS = parseInt(arg('partitions', '4'), 10);
const MAX_MESSAGE_SIZE = parseInt(arg('max-message-size', '1048576'), 10);
const MAX_FRAME_SIZE = parseInt(arg('max-frame-size', '65536'), 10);
const CREATED_AT = Date.now();
const TLS_CERT = arg('tls-cert', null);
const TLS_KEY = arg('tls-key', null);
const WS_PATH = '/$servicebus/websocket';
const WS_PROTOCOL = 'AMQPWSB10';
// Defaults: what the service sends to an idle publisher and to an idle connection.
const DISCONNECT_DEFAULTS = {
    detach: { condition: 'amqp:link:detach-forced', description: 'The link is force detached: idle timeout (test peer).' },
    close: { condition: 'amqp:connection:forced', description: 'The connection was inactive and is closed by container (test peer).' },
};

let events = [];
let stats = {};
let faults = {};
const connections = new Set();

function resetStats() {
    stats = {
        connections: 0, tcp_connections: 0, cbs_requests: 0, cbs_tokens: [],
        mgmt_requests: 0, hub_links: 0, transfers: 0, events: 0, rejected: 0,
        link_errors: 0, cbs_failures: 0, transfer_sizes: [], disconnects: 0,
        tls_connections: 0, ws_connections: 0, ws_refused: 0, ws_paths: [],
    };
}

function clearFaults() {
    faults = {
        cbs_status: null, cbs_count: -1, // answer put-token with this status (e.g. 401)
        link_error: null, link_count: -1, // {condition, description}: refuse hub links (attach, then detach with it)
        reject: null, reject_count: -1, // {condition, description}: reject transfers
        delay_ms: 0, // wait this long before settling a transfer
        silent: false, // accept TCP but never answer (a hung peer)
        on_transfer: null, on_transfer_count: -1, // {how, keep}: disconnect when a hub transfer arrives
    };
}

resetStats();
clearFaults();

// Take one use of a counted fault: count < 0 means forever.
function use(countKey) {
    const n = faults[countKey];
    if (n === 0) return false;
    if (n > 0) faults[countKey] = n - 1;
    return true;
}

// Stable partition for a key (the real service has its own hash; tests only need "same key, same partition").
function partitionFor(key) {
    if (key === undefined || key === null) return null;
    let h = 0;
    for (const ch of Buffer.from(String(key), 'utf8')) h = (h * 31 + ch) >>> 0;
    return String(h % PARTITIONS);
}

function plain(v) {
    if (v === undefined || v === null) return null;
    if (Buffer.isBuffer(v)) return { base64: v.toString('base64') };
    if (v instanceof Date) return v.toISOString();
    if (typeof v === 'bigint') return v.toString();
    if (Array.isArray(v)) return v.map(plain);
    if (typeof v === 'object') {
        if (v.constructor === Object) {
            const o = {};
            for (const k of Object.keys(v)) o[k] = plain(v[k]);
            return o;
        }
        if (typeof v.valueOf === 'function' && v.valueOf() !== v) return plain(v.valueOf());
        return String(v);
    }
    return v;
}

function bodyBytes(msg) {
    const b = msg.body;
    if (b === undefined || b === null) return Buffer.alloc(0);
    if (b.typecode === 0x75) {
        return b.multiple ? Buffer.concat(b.content) : Buffer.from(b.content);
    }
    if (Buffer.isBuffer(b)) return b;
    return Buffer.from(typeof b === 'string' ? b : JSON.stringify(b));
}

function storeEvent(inner, outer, context, size) {
    const annotations = Object.assign({}, outer.message_annotations || {}, inner.message_annotations || {});
    const key = annotations['x-opt-partition-key'];
    const target = context.receiver.target ? context.receiver.target.address : null;
    const m = /\/Partitions\/([^/]+)$/i.exec(target || '');
    const body = bodyBytes(inner);
    events.push({
        seq: events.length,
        connection: context.connection.options.id,
        target: target,
        partition_key: key === undefined ? null : String(key),
        partition: m ? m[1] : partitionFor(key),
        body: body.toString('utf8'),
        body_base64: body.toString('base64'),
        content_type: inner.content_type === undefined ? null : String(inner.content_type),
        message_id: plain(inner.message_id),
        correlation_id: plain(inner.correlation_id),
        subject: plain(inner.subject),
        application_properties: plain(inner.application_properties || {}),
        message_annotations: plain(annotations),
        transfer: stats.transfers,
        transfer_size: size,
    });
    stats.events += 1;
}

function onHubTransfer(context) {
    const delivery = context.delivery;
    const raw = context.message;
    const fault = faults.on_transfer && use('on_transfer_count') ? faults.on_transfer : null;
    const finish = () => {
        if (fault && !fault.keep) {  // lost in flight: neither stored nor settled
            disconnect(context.connection, fault);
            return;
        }
        if (faults.reject && use('reject_count')) {
            stats.rejected += 1;
            delivery.update(true, rhea.message.rejected({ error: faults.reject }).described());
            return;
        }
        stats.transfers += 1;
        let size = 0;
        if (Buffer.isBuffer(raw)) {
            size = raw.length;
            const outer = rhea.message.decode(raw);
            if (context.format === BATCH_FORMAT) {
                const sections = outer.body && outer.body.multiple ? outer.body.content : [outer.body.content];
                for (const data of sections) storeEvent(rhea.message.decode(Buffer.from(data)), outer, context, size);
            } else {
                storeEvent(outer, {}, context, size);
            }
        } else {
            storeEvent(raw, {}, context, size);
        }
        stats.transfer_sizes.push(size);
        if (fault) {  // stored, but the client never learns it: it must send again
            for (const e of events) if (e.transfer === stats.transfers) e.unsettled = true;
            disconnect(context.connection, fault);
            return;
        }
        delivery.update(true, rhea.message.accepted().described());
    };
    if (faults.delay_ms > 0) setTimeout(finish, faults.delay_ms);
    else finish();
}

function reply(connection, address, request, status, description, body) {
    const sender = connection.find_sender((s) => s.source && s.source.address === address && s.is_open());
    if (!sender) return;
    const msg = {
        correlation_id: request.message_id,
        application_properties: {
            'status-code': types.wrap_int(status),
            'status-description': description,
            statusCode: types.wrap_int(status),
            statusDescription: description,
        },
    };
    if (body !== undefined) msg.body = body;
    sender.send(msg);
}

function onCbs(context) {
    const req = context.message;
    const props = req.application_properties || {};
    stats.cbs_requests += 1;
    stats.cbs_tokens.push({ operation: props.operation, type: props.type, name: props.name, token_length: String(req.body || '').length, token: String(req.body || '').slice(0, 4096) });
    let status = 202;
    let text = 'Accepted';
    if (faults.cbs_status && use('cbs_count')) {
        status = faults.cbs_status;
        text = status === 401 ? 'Unauthorized: the token is not valid' : 'Failed';
        stats.cbs_failures += 1;
    }
    context.delivery.update(true, rhea.message.accepted().described());
    reply(context.connection, '$cbs', req, status, text);
}

function onManagement(context) {
    const req = context.message;
    const props = req.application_properties || {};
    stats.mgmt_requests += 1;
    context.delivery.update(true, rhea.message.accepted().described());
    const ids = [];
    for (let i = 0; i < PARTITIONS; i++) ids.push(String(i));
    if (props.name && props.name !== HUB) {
        reply(context.connection, '$management', req, 404, `The messaging entity '${props.name}' could not be found.`);
        return;
    }
    if (props.type === 'com.microsoft:eventhub') {
        reply(context.connection, '$management', req, 200, 'OK', {
            name: HUB,
            type: 'com.microsoft:eventhub',
            created_at: types.wrap_timestamp(CREATED_AT),
            partition_count: types.wrap_int(PARTITIONS),
            partition_ids: ids,
        });
    } else if (props.type === 'com.microsoft:partition') {
        const pid = String(props.partition);
        const mine = events.filter((e) => e.partition === pid);
        reply(context.connection, '$management', req, 200, 'OK', {
            name: HUB,
            type: 'com.microsoft:partition',
            partition: pid,
            begin_sequence_number: types.wrap_long(0),
            last_enqueued_sequence_number: types.wrap_long(mine.length - 1),
            last_enqueued_offset: String(mine.length ? mine.length - 1 : -1),
            last_enqueued_time_utc: types.wrap_timestamp(Date.now()),
            is_partition_empty: mine.length === 0,
        });
    } else {
        reply(context.connection, '$management', req, 400, `unsupported type ${props.type}`);
    }
}

const container = rhea.create_container({ id: 'sefwd-eventhubs-peer', autoaccept: false });
container.sasl_server_mechanisms.enable_anonymous();
container.sasl_server_mechanisms.enable_plain(() => true);

const amqpConnections = new Set();
container.on('connection_open', (context) => {
    stats.connections += 1;
    amqpConnections.add(context.connection);
});
container.on('disconnected', (context) => { amqpConnections.delete(context.connection); });
container.on('connection_close', (context) => { amqpConnections.delete(context.connection); });

// What the service does to a client it is done with: close the connection or detach the hub
// links with an error, or (a middlebox, a crash) just drop the TCP connection.
function disconnect(connection, spec) {
    const how = spec.how || 'close';
    stats.disconnects += 1;
    if (how === 'drop') {
        connection.ignored = true;  // frames already in our buffers die with the connection
        dropSocket(connection);
        return;
    }
    if (how === 'freeze') {
        // A middlebox that forgot the flow (NAT or load-balancer idle timeout): no FIN, no RST,
        // nothing read or answered any more on this connection.
        const socket = connection.socket;
        const ws = socket && typeof socket.get_id_string === 'function' ? websockets.get(socket.get_id_string()) : null;
        if (ws) ws.pause();
        else if (socket && typeof socket.pause === 'function') socket.pause();
        connection.socket_ended = true;
        // ws hands over frames still buffered when the socket is finally destroyed: ignore them too.
        connection.ignored = true;
        return;
    }
    const error = {
        condition: spec.condition || DISCONNECT_DEFAULTS[how].condition,
        description: spec.description || DISCONNECT_DEFAULTS[how].description,
    };
    if (how === 'detach') {
        connection.each_link((link) => {
            const address = link.is_receiver() && link.target ? link.target.address || '' : '$';
            if (!address.startsWith('$') && link.is_open()) {
                link.detached_by_peer = true;
                link.close(error);
            }
        });
    } else {
        connection.ignored = true;  // after our close, nothing more the client sends is taken
        connection.close(error);
        // An idle client reads nothing and never answers the close: end the TCP connection anyway.
        setTimeout(() => dropSocket(connection), 500);
    }
}

function dropSocket(connection) {
    connection.socket_ended = true;
    const socket = connection.socket;
    const ws = socket && typeof socket.get_id_string === 'function' ? websockets.get(socket.get_id_string()) : null;
    if (ws) ws.terminate();
    else if (socket && typeof socket.destroy === 'function') socket.destroy();
}
container.on('error', () => {});

function echoTermini(link) {
    const src = link.source;
    const tgt = link.target;
    link.set_source({ address: src && src.address ? src.address : undefined });
    link.set_target({ address: tgt && tgt.address ? tgt.address : undefined });
}

container.on('receiver_open', (context) => {
    const receiver = context.receiver;
    echoTermini(receiver);
    const address = receiver.target ? receiver.target.address || '' : '';
    if (address === '$cbs' || address === '$management') return;
    stats.hub_links += 1;
    receiver.local.attach.max_message_size = MAX_MESSAGE_SIZE;
    if (faults.link_error && use('link_count')) {
        stats.link_errors += 1;
        receiver.refused = faults.link_error;
        receiver.close(faults.link_error);
    }
});

container.on('sender_open', (context) => {
    echoTermini(context.sender);
});

container.on('message', (context) => {
    // A transfer that crossed our detach on the wire: the link is gone, the message is not taken.
    if (context.receiver.detached_by_peer || context.connection.ignored) return;
    if (context.receiver.refused) {
        // We refused this link (a client may re-attach it under the same name): nothing it sends is taken.
        context.delivery.update(true, rhea.message.rejected({ error: context.receiver.refused }).described());
        return;
    }
    const address = context.receiver.target ? context.receiver.target.address || '' : '';
    if (address === '$cbs') onCbs(context);
    else if (address === '$management') onManagement(context);
    else onHubTransfer(context);
});

// --- listeners that can be taken down and brought back on the same ports -------------------
const sockets = new Set();
const websockets = new Map();
const ports = { amqp: parseInt(arg('port', '0'), 10), amqps: 0, wss: 0 };
let servers = [];

function track(socket, kind) {
    sockets.add(socket);
    stats.tcp_connections += 1;
    if (kind === 'amqps') stats.tls_connections += 1;
    socket.on('close', () => sockets.delete(socket));
    if (faults.silent && kind === 'amqp') {
        // A hung peer: swallow everything (the TLS handshake too), answer nothing.
        socket.removeAllListeners('data');
        socket.pause();
    }
}

const LISTEN_OPTIONS = { max_frame_size: MAX_FRAME_SIZE, channel_max: 255, idle_time_out: 0, container_id: 'sefwd-eventhubs-peer' };

// TLS listeners get a plain TCP front that hands each socket to the TLS server, or (fault "silent")
// holds it unanswered: a TLS server starts its handshake itself, before any listener could stop it.
function tlsFront(kind, inner, done) {
    const front = net.createServer((socket) => {
        track(socket, kind);
        if (!faults.silent) inner.emit('connection', socket);
    });
    front.inner = inner;
    front.listen(ports[kind], HOST);
    front.once('listening', () => { ports[kind] = front.address().port; done(null, front); });
    front.once('error', (err) => done(err));
}

function startAmqp(kind, done) {
    if (kind === 'amqps') {
        const inner = container.listen(Object.assign({ port: 0, host: HOST, transport: 'tls',
            key: fs.readFileSync(TLS_KEY), cert: fs.readFileSync(TLS_CERT) }, LISTEN_OPTIONS));
        inner.once('listening', () => tlsFront(kind, inner, done));
        return;
    }
    const server = container.listen(Object.assign({ port: ports[kind], host: HOST }, LISTEN_OPTIONS));
    server.on('connection', (socket) => track(socket, kind));
    server.once('listening', () => { ports[kind] = server.address().port; done(null, server); });
    server.once('error', (err) => done(err));
}

function startWss(done) {
    const server = https.createServer({ key: fs.readFileSync(TLS_KEY), cert: fs.readFileSync(TLS_CERT) });
    const wss = new WebSocketServer({
        server: server,
        // The service answers only on its WebSocket path and only the AMQP subprotocol.
        verifyClient: (info) => {
            stats.ws_paths.push(info.req.url);
            const ok = info.req.url === WS_PATH;
            if (!ok) stats.ws_refused += 1;
            return ok;
        },
        handleProtocols: (protocols) => (protocols.has(WS_PROTOCOL) ? WS_PROTOCOL : false),
    });
    wss.on('connection', (ws) => {
        stats.ws_connections += 1;
        // rhea's wrapper only closes gracefully; an id (its get_id_string) lets dropSocket terminate it.
        const id = 'ws-' + stats.ws_connections;
        Object.defineProperty(ws, 'url', { value: id });
        websockets.set(id, ws);
        ws.on('close', () => websockets.delete(id));
        container.websocket_accept(ws, LISTEN_OPTIONS);
    });
    server.closeAll = () => { for (const ws of wss.clients) ws.terminate(); wss.close(); };
    tlsFront('wss', server, done);
}

function listen(cb) {
    const starters = [(done) => startAmqp('amqp', done)];
    if (TLS_CERT && TLS_KEY) starters.push((done) => startAmqp('amqps', done), startWss);
    const next = (i) => {
        if (i === starters.length) return cb();
        starters[i]((err, server) => {
            if (err) {
                console.error('listen error: ' + err.message);
                return cb(err);
            }
            servers.push(server);
            next(i + 1);
        });
    };
    next(0);
}

function down(cb) {
    const closing = servers;
    servers = [];
    let left = closing.length;
    if (!left) return cb();
    for (const s of closing) {
        if (s.inner) {
            if (s.inner.closeAll) s.inner.closeAll();
            if (s.inner.listening) s.inner.close();
        }
        s.close(() => { if (--left === 0) cb(); });
    }
    for (const socket of sockets) socket.destroy();
}

function setFaults(body) {
    for (const k of Object.keys(body)) {
        if (!(k in faults)) throw new Error('unknown fault ' + k);
        faults[k] = body[k];
    }
}

function readBody(req, cb) {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        cb(text ? JSON.parse(text) : {});
    });
}

const control = http.createServer((req, res) => {
    const send = (status, obj) => {
        const data = JSON.stringify(obj);
        res.writeHead(status, { 'content-type': 'application/json' });
        res.end(data);
    };
    try {
        if (req.method === 'GET' && req.url === '/events') return send(200, events);
        if (req.method === 'GET' && req.url === '/stats') {
            return send(200, Object.assign({}, stats, { open_connections: sockets.size, up: servers.length > 0, amqp_port: ports.amqp, faults: faults }));
        }
        if (req.method === 'POST') {
            return readBody(req, (body) => {
                try {
                    if (req.url === '/faults') { setFaults(body); return send(200, faults); }
                    if (req.url === '/reset') { events = []; resetStats(); clearFaults(); return send(200, {}); }
                    if (req.url === '/disconnect') {
                        // Only connections still open both ways (rhea reports no disconnect for one it closed itself).
                        const open = Array.from(amqpConnections).filter((c) => c.is_open() && !c.socket_ended);
                        for (const c of open) disconnect(c, body);
                        return send(200, { connections: open.length });
                    }
                    if (req.url === '/down') return down(() => send(200, { up: false }));
                    if (req.url === '/up') {
                        if (servers.length) return send(200, { up: true });
                        return listen((err) => send(err ? 500 : 200, { up: !err, error: err ? err.message : null }));
                    }
                    send(404, { error: 'not found' });
                } catch (e) {
                    send(400, { error: e.message });
                }
            });
        }
        send(404, { error: 'not found' });
    } catch (e) {
        send(500, { error: e.message });
    }
});

listen((err) => {
    if (err) process.exit(2);
    const startDown = process.argv.includes('--down');
    const ready = () => control.listen(parseInt(arg('control-port', '0'), 10), HOST, () => {
        process.stdout.write(JSON.stringify({
            amqp_port: ports.amqp, amqps_port: ports.amqps || null, wss_port: ports.wss || null,
            control_port: control.address().port,
        }) + '\n');
    });
    if (startDown) down(ready); else ready();
});

process.on('SIGTERM', () => process.exit(0));
process.on('SIGINT', () => process.exit(0));
