#!/usr/bin/python
# The current seed's "Python Sample" polling loop (Scheduled Events for Windows VMs,
# api-version 2020-07-01), unchanged except: the URL and the interval come from argv (the
# sample sleeps 1 s), and it polls until killed instead of returning after one new document.
# Used by benchmarks/poll_cost.py as the baseline an agent must not be more expensive than.
import json
import sys
from time import sleep

import requests

metadata_url = sys.argv[1]
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
header = {'Metadata' : 'true'}
query_params = {'api-version':'2020-07-01'}

def get_scheduled_events():
    resp = requests.get(metadata_url, headers = header, params = query_params)
    data = resp.json()
    return data

def confirm_scheduled_event(event_id):
    payload = json.dumps({"StartRequests": [{"EventId": event_id }]})
    response = requests.post(metadata_url, headers= header, params = query_params, data = payload)
    return response.status_code

def log(event):
    print(event["Description"])

def process(payload):
    # The sample's per-document processing, run when DocumentIncarnation changes.
    for event in payload["Events"]:
        if (event["EventStatus"] == "Started"):
            log(event)
        elif (event["EventSource"] == "User"):
            confirm_scheduled_event(event["EventId"])
        elif (event["EventType"] == "Freeze" and
            int(event["DurationInSeconds"]) >= 0  and
            int(event["DurationInSeconds"]) < 9):
            confirm_scheduled_event(event["EventId"])
        else:
            log(event)
    print("Processed events from document: " + str(payload["DocumentIncarnation"]))
    sys.stdout.flush()

def main():
    last_document_incarnation = "-1"
    while True:
        sleep(interval)
        payload = get_scheduled_events()
        found_document_incarnation = payload["DocumentIncarnation"]
        if found_document_incarnation != last_document_incarnation:
            process(payload)
            last_document_incarnation = found_document_incarnation

if __name__ == '__main__':
    main()
