// Checks KQL queries with Microsoft's Kusto language service (@kusto/language-service-next), offline.
// stdin: {"tables": {"Name": "(col:type, ...)"}, "queries": [{"name": "...", "query": "..."}]}
// stdout: [{"name": "...", "diagnostics": [{"code", "severity", "message", "start", "length"}]}]
// A query that names a table not declared, a column the table does not have, a wrong type in an
// operator the analyzer types, or a syntax error, gets an error diagnostic.
"use strict";
require("@kusto/language-service-next/bridge.min.js");
require("@kusto/language-service-next/Kusto.Language.Bridge.min.js");

const K = global.Kusto.Language;
const Sym = K.Symbols;

function globalsFor(tables) {
  const symbols = Object.entries(tables).map(([name, schema]) => new Sym.TableSymbol.$ctor7(name, schema, null));
  const db = new Sym.DatabaseSymbol.$ctor1("sefwd", symbols, false);
  return K.GlobalState.Default.WithDatabase(db);
}

function check(query, globals) {
  const code = K.KustoCode.ParseAndAnalyze(query, globals);
  const list = code.GetDiagnostics();
  const out = [];
  for (let i = 0; i < list.Count; i++) {
    const d = list.getItem(i);
    out.push({code: d.Code, severity: d.Severity, message: d.Message, start: d.Start, length: d.Length});
  }
  return out;
}

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  const request = JSON.parse(input);
  const cache = new Map();
  const results = request.queries.map((q) => {
    const tables = q.tables || request.tables;
    const key = JSON.stringify(tables);
    if (!cache.has(key)) cache.set(key, globalsFor(tables));
    return {name: q.name, diagnostics: check(q.query, cache.get(key))};
  });
  process.stdout.write(JSON.stringify(results));
});
