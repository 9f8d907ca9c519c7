// What Microsoft's Node sample client depends on, written here: every request says
// "Connection: close" (node-fetch 2 does) while going through one keep-alive agent (Node's global
// agent keeps sockets alive since Node 19), and the approval POST follows the GET at once.
// A server that closes without answering "Connection: close" makes the POST go out on a dead
// socket: "socket hang up". Usage: node node_keepalive_client.js BASE_URL ROUNDS
"use strict";
const http = require("http");

const base = new URL(process.argv[2]);
const rounds = Number(process.argv[3] || "3");
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
const path = "/metadata/scheduledevents?api-version=2020-07-01";

function request(method, body) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      {
        host: base.hostname, port: base.port, path, method, agent,
        headers: {
          Metadata: "true", Connection: "close", "Content-Type": "application/json",
          ...(body ? { "Content-Length": Buffer.byteLength(body) } : {}),
        },
      },
      (res) => {
        let data = "";
        res.setEncoding("utf8");
        res.on("data", (chunk) => (data += chunk));
        res.on("end", () => resolve({ status: res.statusCode, connection: res.headers.connection, data }));
      },
    );
    req.on("error", reject);
    if (body) req.write(body);
    req.end();
  });
}

(async () => {
  for (let i = 0; i < rounds; i++) {
    const got = await request("GET");
    const doc = JSON.parse(got.data);
    const ids = doc.Events.filter((e) => e.EventStatus === "Scheduled").map((e) => e.EventId);
    console.log(`GET ${got.status} connection=${got.connection} scheduled=${ids.join(",")}`);
    if (ids.length) {
      const body = JSON.stringify({ StartRequests: ids.map((EventId) => ({ EventId })) });
      const posted = await request("POST", body);
      console.log(`POST ${posted.status} connection=${posted.connection}`);
    }
  }
})().catch((err) => {
  console.log(`ERROR ${err.message}`);
  process.exit(1);
});
