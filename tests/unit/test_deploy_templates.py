"""The deployment artifacts are well-formed: ARM templates, KQL queries and workbook, Logic App.

No Azure is needed: these are static checks of what ``az deployment group create``, the Logs blade
and the Logic Apps designer would refuse or get wrong. The Log Analytics template's table and DCR
columns are checked against ``sinks.la_schema.COLUMNS`` in ``tests/unit/test_la_schema.py``; every KQL
query is checked by Microsoft's Kusto language service in ``tests/unit/test_kql.py``.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sinks.la_schema import TABLE

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "dashboards"
TEMPLATES = sorted((DEPLOY / "azure").glob("**/*.json")) + [DASHBOARDS / "azuredeploy.json"]
QUERIES = sorted((DASHBOARDS / "queries").glob("*.kql"))
WORKFLOW = DEPLOY / "consumers" / "logic-app" / "workflow.json"

EVENT_HUBS_DATA_SENDER = "2b629674-e913-4c01-ae53-ef4638d8f975"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _strings(value: Any) -> list[str]:
    """Every string value in a JSON document (keys excluded)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    return []


def _expressions(value: Any) -> list[str]:
    """ARM template expressions: strings in brackets that are not the "[[" literal escape."""
    return [s for s in _strings(value) if s.startswith("[") and s.endswith("]") and not s.startswith("[[")]


def _balanced(expression: str) -> bool:
    """Parentheses and brackets match outside single-quoted strings ('' is an escaped quote)."""
    closing = {")": "(", "]": "["}
    stack: list[str] = []
    in_string = False
    for char in expression:
        if char == "'":
            in_string = not in_string
        elif in_string:
            continue
        elif char in "([":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack and not in_string


def _template_id(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


# -- ARM templates --------------------------------------------------------------------------------

def test_the_expected_templates_exist():
    names = {_template_id(p) for p in TEMPLATES}
    assert {"azure/eventhubs/azuredeploy.json", "azure/vm-extension/azuredeploy.json",
            "azure/loganalytics/azuredeploy.json", "dashboards/azuredeploy.json",
            "azure/platform-events/azuredeploy.json", "azure/approver-state/azuredeploy.json"} <= names


@pytest.mark.parametrize("path", TEMPLATES, ids=_template_id)
def test_template_has_the_deployment_template_shape(path: Path):
    template = _load(path)
    assert template["$schema"].startswith("https://schema.management.azure.com/schemas/")
    assert template["$schema"].endswith("/deploymentTemplate.json#")
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", template["contentVersion"])
    assert isinstance(template["resources"], list) and template["resources"]
    for resource in template["resources"]:
        assert {"type", "apiVersion", "name"} <= set(resource), resource
        # ARM refuses an expression as apiVersion.
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}(-preview)?", resource["apiVersion"]), resource["apiVersion"]


@pytest.mark.parametrize("path", TEMPLATES, ids=_template_id)
def test_every_parameter_is_documented_and_used(path: Path):
    template = _load(path)
    body = json.dumps({k: v for k, v in template.items() if k != "parameters"})
    for name, spec in template.get("parameters", {}).items():
        description = spec.get("metadata", {}).get("description", "")
        assert len(description) > 10, f"parameter {name} has no metadata.description"
        assert f"parameters('{name}')" in body, f"parameter {name} is declared but never used"


@pytest.mark.parametrize("path", TEMPLATES, ids=_template_id)
def test_every_reference_is_declared_and_every_expression_balanced(path: Path):
    template = _load(path)
    text = json.dumps(template)
    for kind, section in (("parameters", "parameters"), ("variables", "variables")):
        for name in re.findall(rf"\b{kind}\('([^']+)'\)", text):
            assert name in template.get(section, {}), f"{kind}('{name}') is not declared"
    expressions = _expressions(template)
    assert expressions
    for expression in expressions:
        assert _balanced(expression[1:-1]), expression


@pytest.mark.parametrize("path", TEMPLATES, ids=_template_id)
def test_secure_parameters_never_reach_outputs(path: Path):
    template = _load(path)
    outputs = json.dumps(template.get("outputs", {}))
    for name, spec in template.get("parameters", {}).items():
        if spec["type"].lower() in ("securestring", "secureobject"):
            assert f"parameters('{name}')" not in outputs, name


def test_the_balance_check_catches_a_broken_expression():
    assert _balanced("format('{0}/{1}', parameters('a'), parameters('b'))")
    assert _balanced("concat('it''s (', parameters('a'))")
    assert not _balanced("format('{0}', parameters('a')")
    assert not _balanced("split(x, '//')[1")


def _resources(path: Path, rtype: str) -> list[dict[str, Any]]:
    return [r for r in _load(path)["resources"] if r["type"] == rtype]


def test_event_hubs_template_creates_namespace_hub_consumer_group_and_sender_role():
    path = DEPLOY / "azure" / "eventhubs" / "azuredeploy.json"
    (namespace,) = _resources(path, "Microsoft.EventHub/namespaces")
    assert namespace["sku"]["name"] == "Standard"
    assert namespace["properties"]["minimumTlsVersion"] == "1.2"
    (hub,) = _resources(path, "Microsoft.EventHub/namespaces/eventhubs")
    assert hub["properties"]["partitionCount"] == "[parameters('partitionCount')]"
    (group,) = _resources(path, "Microsoft.EventHub/namespaces/eventhubs/consumergroups")
    assert "parameters('consumerGroupName')" in group["name"]
    (assignment,) = _resources(path, "Microsoft.Authorization/roleAssignments")
    assert EVENT_HUBS_DATA_SENDER in json.dumps(assignment)
    assert assignment["properties"]["principalId"] == "[parameters('principalId')]"
    assert "eventhubs/" in assignment["scope"]  # least privilege: the hub, not the namespace
    assert assignment["condition"] == "[not(empty(parameters('principalId')))]"
    outputs = _load(path)["outputs"]
    assert {"fullyQualifiedNamespace", "eventHubName", "consumerGroupName"} <= set(outputs)


def test_vm_extension_template_maps_public_and_protected_settings():
    path = DEPLOY / "azure" / "vm-extension" / "azuredeploy.json"
    template = _load(path)
    assert template["parameters"]["publicSettings"]["type"] == "object"
    assert template["parameters"]["protectedSettings"]["type"] == "secureObject"
    kinds = {r["type"]: r for r in template["resources"]}
    assert set(kinds) == {"Microsoft.Compute/virtualMachines/extensions", "Microsoft.Compute/virtualMachineScaleSets/extensions"}
    for resource in kinds.values():
        props = resource["properties"]
        assert props["settings"] == "[parameters('publicSettings')]"
        assert props["protectedSettings"] == "[parameters('protectedSettings')]"
        assert props["publisher"] == "[parameters('publisher')]"
        assert props["type"] == "[parameters('extensionType')]"
        assert props["typeHandlerVersion"] == "[parameters('typeHandlerVersion')]"
        assert "parameters('targetType')" in resource["condition"]


# -- dashboards -----------------------------------------------------------------------------------

def _build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_workbook", DASHBOARDS / "build_workbook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kql_code(text: str) -> str:
    """The query with comments and string literals blanked out, so only code identifiers remain."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        if char in "\"'":
            j = i + 1
            while j < len(text) and text[j] != char:
                j += 2 if text[j] == "\\" else 1
            out.append(" ")
            i = j + 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


def test_there_are_queries_for_each_dashboard_topic():
    names = " ".join(p.stem for p in QUERIES)
    for topic in ("upcoming", "by-type", "scheduled-to-started", "approvals", "heartbeat"):
        assert topic in names, topic


@pytest.mark.parametrize("path", QUERIES, ids=lambda p: p.name)
def test_query_has_a_header_and_reads_the_table(path: Path):
    # (Columns, types and syntax: Microsoft's Kusto language service checks them, tests/unit/test_kql.py.)
    text = path.read_text(encoding="utf-8")
    header = _build_module().parse_header(text)
    assert header["title"]
    assert TABLE in text
    assert "RecordType" in _kql_code(text)


@pytest.mark.parametrize("path", QUERIES, ids=lambda p: p.name)
def test_query_collapses_at_least_once_duplicates(path: Path):
    code = _kql_code(path.read_text(encoding="utf-8"))
    # Either explicitly one row per RecordId, or one row per VM (a duplicate cannot survive that).
    assert re.search(r"arg_max\(TimeGenerated, \*\) by (RecordId|Source)\b", code), path.name


def _query(fragment: str) -> str:
    (path,) = [p for p in QUERIES if fragment in p.stem]
    return path.read_text(encoding="utf-8")


def test_upcoming_query_keeps_the_latest_open_state_per_vm_and_event():
    code = _kql_code(_query("upcoming"))
    assert "by Source, EventId" in code
    assert "Change !in (" in code and "completed" in _query("upcoming") and "canceled" in _query("upcoming")
    assert "NotBefore > now()" in code


def test_scheduled_to_started_query_pairs_the_two_event_keys():
    text = _query("03-scheduled-to-started")
    assert ':scheduled"' in text and ':started"' in text and "Started - Scheduled" in text


def test_heartbeat_query_flags_stopped_agents_and_three_missed_heartbeats():
    text = _query("heartbeat")
    assert '"forwarder.heartbeat"' in text and '"forwarder.stopped"' in text
    assert "3 * HeartbeatInterval" in text


def test_approvals_query_shows_who_approved():
    code = _kql_code(_query("05-approvals"))
    for column in ("Outcome", "Actor", "Approver", "Rule", "Reason"):
        assert column in code


def test_workbook_embeds_every_query_verbatim_and_is_what_the_builder_writes():
    module = _build_module()
    committed = (DASHBOARDS / "workbook.json").read_text(encoding="utf-8")
    assert committed == module.render(module.workbook()), "run deploy/dashboards/build_workbook.py"
    assert (DASHBOARDS / "azuredeploy.json").read_text(encoding="utf-8") == module.render(module.template())
    workbook = json.loads(committed)
    assert workbook["version"] == "Notebook/1.0"
    kql_items = [item["content"] for item in workbook["items"] if item["type"] == 3]
    assert [c["query"] for c in kql_items] == [p.read_text(encoding="utf-8") for p in QUERIES]
    for content in kql_items:
        assert content["version"] == "KqlItem/1.0"
        assert content["resourceType"] == "microsoft.operationalinsights/workspaces"
        assert "timeContext" in content or content.get("timeContextFromParameter") == "TimeRange"
    parameters = [p["name"] for item in workbook["items"] if item["type"] == 9 for p in item["content"]["parameters"]]
    assert "TimeRange" in parameters


def test_workbook_template_serializes_the_same_workbook_for_the_workspace():
    template = _load(DASHBOARDS / "azuredeploy.json")
    content = template["variables"]["workbookContent"]
    workbook = _load(DASHBOARDS / "workbook.json")
    # The template's copy differs only by ARM escaping and the workspace-bound fallbackResourceIds.
    assert [i["content"].get("query") for i in content["items"]] == [i["content"].get("query") for i in workbook["items"]]
    assert not _expressions(content), "a workbook string would be evaluated as an ARM expression"
    (resource,) = template["resources"]
    assert resource["type"] == "Microsoft.Insights/workbooks"
    assert "variables('workbookContent')" in resource["properties"]["serializedData"]
    assert "fallbackResourceIds" in resource["properties"]["serializedData"]


# -- Logic App ------------------------------------------------------------------------------------

def _actions(actions: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every action, nested ones (If / else) included, by name."""
    found: dict[str, dict[str, Any]] = {}
    for name, action in actions.items():
        found[name] = action
        found.update(_actions(action.get("actions", {})))
        found.update(_actions(action.get("else", {}).get("actions", {})))
    return found


def test_logic_app_workflow_notifies_once_per_eventkey():
    document = _load(WORKFLOW)
    definition = document["definition"]
    assert definition["$schema"].endswith("/workflowdefinition.json#")
    assert definition["triggers"] and definition["actions"]
    text = json.dumps(definition)
    assert "scheduledevent.scheduled" in text and "eventkey" in text
    actions = _actions(definition["actions"])
    claim = actions["Claim_eventkey"]
    assert claim["inputs"]["method"] == "POST" and ".table.core.windows.net/" in claim["inputs"]["uri"]
    assert "['eventkey']" in claim["inputs"]["body"]["RowKey"]
    assert claim["inputs"]["authentication"]["type"] == "ManagedServiceIdentity"
    notify = actions["Post_message_in_a_chat_or_channel"]
    assert notify["runAfter"] == {"Claim_eventkey": ["Succeeded"]}
    duplicate = actions["Already_notified"]
    assert duplicate["runAfter"]["Claim_eventkey"] == ["Failed", "TimedOut"]
    assert 409 in json.loads(json.dumps(duplicate["expression"]))["and"][0]["equals"]


def test_logic_app_references_resolve():
    document = _load(WORKFLOW)
    definition = document["definition"]
    text = json.dumps(definition)
    declared = definition["parameters"]
    for name in set(re.findall(r"parameters\('([^']+)'\)", text)):
        assert name in declared, name
    for name, spec in declared.items():
        assert "defaultValue" in spec or name in document["parameters"], f"{name} has no value"
    for name in set(re.findall(r"\$connections'\)\['(\w+)'\]", text)):
        assert name in document["parameters"]["$connections"]["value"], name
    actions = _actions(definition["actions"])
    for name in set(re.findall(r"outputs\('(\w+)'\)", text)):
        assert name in actions, name

    def check_run_after(siblings: dict[str, Any]) -> None:
        for action in siblings.values():
            for dependency in action.get("runAfter", {}):
                assert dependency in siblings, dependency
            check_run_after(action.get("actions", {}))
            check_run_after(action.get("else", {}).get("actions", {}))

    check_run_after(definition["actions"])


# -- guides ---------------------------------------------------------------------------------------

GUIDES = [DEPLOY / "README.md", DEPLOY / "azure" / "README.md", DASHBOARDS / "README.md",
          DEPLOY / "consumers" / "logic-app" / "README.md", DEPLOY / "consumers" / "platform-events" / "README.md"]


@pytest.mark.parametrize("path", GUIDES, ids=_template_id)
def test_guide_links_and_commands_point_at_files_that_exist(path: Path):
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
    # Files named in commands (deploy/...), relative to the repository root.
    for target in set(re.findall(r"(?<![\w/.])(deploy/[\w./-]+\.(?:json|sh|ps1|py|yaml|yml|kql))", text)):
        assert (ROOT / target).exists(), f"{path.name} names missing {target}"


STORAGE_TABLE_DATA_CONTRIBUTOR = "0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3"


def test_approver_state_template_creates_the_table_and_grants_its_role_on_the_table_alone():
    path = DEPLOY / "azure" / "approver-state" / "azuredeploy.json"
    (account,) = _resources(path, "Microsoft.Storage/storageAccounts")
    props = account["properties"]
    assert props["minimumTlsVersion"] == "TLS1_2" and props["supportsHttpsTrafficOnly"] is True
    assert props["allowSharedKeyAccess"] is False  # Entra ID (the app's managed identity) only: no account key
    (table,) = _resources(path, "Microsoft.Storage/storageAccounts/tableServices/tables")
    assert "parameters('tableName')" in table["name"]
    (assignment,) = _resources(path, "Microsoft.Authorization/roleAssignments")
    assert STORAGE_TABLE_DATA_CONTRIBUTOR in assignment["properties"]["roleDefinitionId"]
    assert assignment["properties"]["principalId"] == "[parameters('principalId')]"
    # Least privilege: the one table, not the account, the group or the subscription.
    assert assignment["scope"] == ("[format('Microsoft.Storage/storageAccounts/{0}/tableServices/default/tables/{1}', "
                                   "parameters('storageAccountName'), parameters('tableName'))]")
    assert set(_load(path)["outputs"]) == {"stateTableEndpoint", "stateTableName"}
# -- Scheduled Events in Event Grid (issue 33) ------------------------------------------------------

PLATFORM_EVENTS = DEPLOY / "azure" / "platform-events" / "azuredeploy.json"


def test_platform_events_template_sets_the_published_policy_shape():
    template = _load(PLATFORM_EVENTS)
    policy = template["variables"]["scheduledEventsPolicy"]
    # The shape of Microsoft's example (azure-rest-api-specs, Compute 2024-11-01,
    # AvailabilitySet_Create_WithScheduledEventProfile.json): these keys, nothing else.
    assert set(policy) == {"scheduledEventsAdditionalPublishingTargets", "userInitiatedReboot", "userInitiatedRedeploy"}
    assert policy["scheduledEventsAdditionalPublishingTargets"] == {
        "eventGridAndResourceGraph": {"enable": "[parameters('enableEventGridAndResourceGraph')]"}}
    assert policy["userInitiatedReboot"] == {"automaticallyApprove": "[parameters('userInitiatedRebootAutoApprove')]"}
    assert policy["userInitiatedRedeploy"] == {"automaticallyApprove": "[parameters('userInitiatedRedeployAutoApprove')]"}
    # Auto-approval takes the VMs out of the loop: off unless asked for.
    assert template["parameters"]["userInitiatedRebootAutoApprove"]["defaultValue"] is False
    assert template["parameters"]["userInitiatedRedeployAutoApprove"]["defaultValue"] is False
    (avset,) = [r for r in template["resources"] if r["type"] == "Microsoft.Compute/availabilitySets"]
    assert avset["apiVersion"] >= "2024-11-01" and avset["condition"].startswith("[not(empty(")
    assert avset["properties"]["scheduledEventsPolicy"] == "[variables('scheduledEventsPolicy')]"
    assert template["outputs"]["scheduledEventsPolicy"]["value"] == "[variables('scheduledEventsPolicy')]"


def test_platform_events_template_subscribes_the_function_to_the_system_topic():
    template = _load(PLATFORM_EVENTS)
    (topic,) = [r for r in template["resources"] if r["type"] == "Microsoft.EventGrid/systemTopics"]
    assert topic["location"] == "global" and topic["properties"]["source"] == "[subscription().id]"
    assert topic["properties"]["topicType"] == "Microsoft.ResourceNotifications.MaintenanceResources"
    (sub,) = [r for r in template["resources"] if r["type"] == "Microsoft.EventGrid/systemTopics/eventSubscriptions"]
    assert template["variables"]["eventType"] == "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted"
    assert sub["properties"]["filter"]["includedEventTypes"] == ["[variables('eventType')]"]
    assert sub["properties"]["eventDeliverySchema"] == "EventGridSchema"
    destination = sub["properties"]["destination"]
    assert destination["endpointType"] == "AzureFunction"
    assert "Microsoft.Web/sites/functions" in destination["properties"]["resourceId"]
    # The default function name is the Event Grid trigger the consumer defines.
    app = (DEPLOY / "consumers" / "platform-events" / "function_app.py").read_text(encoding="utf-8")
    default = template["parameters"]["functionName"]["defaultValue"]
    assert re.search(rf'@app\.function_name\("{default}"\)\s*\n@app\.event_grid_trigger', app)
