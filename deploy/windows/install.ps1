#Requires -Version 5.1
#Requires -RunAsAdministrator
<#
.SYNOPSIS
    Install sefwd (Azure Scheduled Events forwarder) as the Windows service "sefwd".

.DESCRIPTION
    Layout (the same as deploy/linux, with Windows roots):
      $env:ProgramFiles\sefwd\venv              the agent (venv\Scripts\sefwd.exe)      ~ /opt/sefwd/venv
      $env:ProgramFiles\sefwd\sefwd-service.exe  WinSW, the service host                  ~ sefwd.service
      $env:ProgramFiles\sefwd\sefwd-service.xml  its configuration (no secrets)
      $env:ProgramData\sefwd\config.toml         configuration, written only if absent    ~ /etc/sefwd/config.toml
      $env:ProgramData\sefwd\secrets\            secret files named by *_file keys        ~ /etc/sefwd/env
      $env:ProgramData\sefwd\state               journal, cursors, dead letters           ~ /var/lib/sefwd
      $env:ProgramData\sefwd\logs                file sink + service logs                 ~ /var/log/sefwd
    $env:ProgramData\sefwd and everything below it: SYSTEM and Administrators only. The folder is
    created with that ACL in one step; one that already exists but belongs to anyone else (any
    user may create folders in ProgramData) is refused, never adopted (deploy/windows/acl_plan.py).
    The service runs as LocalSystem, starts automatically and restarts after a failure (5 s).

    The service host is WinSW (https://github.com/winsw/winsw, MIT), pinned by version and SHA-256.
    A Python console program cannot be a service by itself (it never answers the service control
    manager, which kills it after 30 s); WinSW answers for it and stops it with Ctrl+C, which the
    agent handles like SIGTERM (drain, then exit). See README.md for why not NSSM or pywin32.

    Re-running upgrades in place: the service is stopped, the venv upgraded, the service
    re-registered and started; config.toml is never overwritten.

.EXAMPLE
    .\install.ps1 -Source C:\src\scheduled-events-forwarder
.EXAMPLE
    .\install.ps1 -Source .\scheduled_events_forwarder-0.1.0-py3-none-any.whl -Extras eventhubs
.EXAMPLE
    .\install.ps1 -Source scheduled-events-forwarder==0.1.0 -WinSWPath C:\tools\WinSW-x64.exe -NoStart
#>
[CmdletBinding()]
param(
    # A checkout (directory with pyproject.toml), a wheel/sdist file, a URL (git+https://...@TAG,
    # https://.../x.whl) or a requirement (scheduled-events-forwarder==0.1.0).
    # Default: the checkout this script is in, else scheduled-events-forwarder from the index.
    [string]$Source = '',
    # Comma-separated extras; '' for none, 'all' for every sink and telemetry.
    [string]$Extras = 'eventhubs,loganalytics',
    # python.exe (>= 3.10, installed for all users). Default: the py launcher's newest 3.x, else python.exe on PATH.
    [string]$Python = '',
    # A WinSW-x64.exe already downloaded (offline machines). It is checked against -WinSWSha256 all the same.
    [string]$WinSWPath = '',
    [string]$WinSWSha256 = '05B82D46AD331CC16BDC00DE5C6332C1EF818DF8CEEFCD49C726553209B3A0DA',
    # Register the service but do not start it.
    [switch]$NoStart
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'
$ProgressPreference = 'SilentlyContinue'  # Invoke-WebRequest is many times slower with a progress bar

$ServiceId = 'sefwd'
$Dist = 'scheduled-events-forwarder'
$WinSWVersion = '2.12.0'
$WinSWUrl = "https://github.com/winsw/winsw/releases/download/v$WinSWVersion/WinSW-x64.exe"

$InstallDir = Join-Path $env:ProgramFiles 'sefwd'
$Venv = Join-Path $InstallDir 'venv'
$VenvPython = Join-Path $Venv 'Scripts\python.exe'
$SefwdExe = Join-Path $Venv 'Scripts\sefwd.exe'
$ServiceExe = Join-Path $InstallDir 'sefwd-service.exe'
$ServiceXml = Join-Path $InstallDir 'sefwd-service.xml'  # WinSW reads <its own name>.xml
$DataDir = Join-Path $env:ProgramData 'sefwd'
$ConfigPath = Join-Path $DataDir 'config.toml'
$SecretsDir = Join-Path $DataDir 'secrets'
$StateDir = Join-Path $DataDir 'state'
$LogDir = Join-Path $DataDir 'logs'

function Say([string]$Message) { Write-Host "install.ps1: $Message" }

function Invoke-Checked([string]$Exe, [string[]]$Arguments) {
    # Windows PowerShell does not stop on a native command's exit code: check it here.
    & $Exe @Arguments
    if ($LASTEXITCODE -ne 0) { throw "$Exe $($Arguments -join ' ') failed with exit code $LASTEXITCODE" }
}

function Get-PythonVersion([string]$Exe) {
    try {
        # No double quotes inside: Windows PowerShell drops them from native arguments.
        $v = & $Exe -c 'import sys, venv, ensurepip; print(*sys.version_info[:2], sep=chr(46))' 2>$null
        if ($LASTEXITCODE -eq 0 -and $v) { return [version]("$v".Trim()) }
    } catch { }
    return $null
}

function Find-Python {
    if ($Python) {
        $exe = (Get-Command -Name $Python -CommandType Application | Select-Object -First 1).Source
        $v = Get-PythonVersion $exe
        if (-not $v -or $v -lt [version]'3.10') { throw "$Python is not Python >= 3.10 with venv" }
        return $exe
    }
    $candidates = @()
    $py = Get-Command py.exe -ErrorAction SilentlyContinue
    if ($py) {
        try {
            $exe = & $py.Source -3 -c 'import sys; print(sys.executable)' 2>$null
            if ($LASTEXITCODE -eq 0 -and $exe) { $candidates += "$exe".Trim() }
        } catch { }  # a py launcher without any Python 3 writes to stderr, which Stop turns into an error
    }
    # Skip the Microsoft Store alias in WindowsApps: it is per user and not a real interpreter.
    $candidates += @(Get-Command python.exe -All -ErrorAction SilentlyContinue |
        Where-Object { $_.Source -notlike '*\WindowsApps\*' } | ForEach-Object { $_.Source })
    foreach ($exe in $candidates) {
        $v = Get-PythonVersion $exe
        if ($v -and $v -ge [version]'3.10') { return $exe }
    }
    throw 'Python >= 3.10 not found. Install it for all users, e.g.: winget install --id Python.Python.3.12 --scope machine  (or pass -Python C:\path\python.exe)'
}

function Get-Requirement([string]$Src, [string]$Spec, [string]$Work) {
    if (Test-Path -LiteralPath $Src -PathType Container) {
        if (-not (Test-Path -LiteralPath (Join-Path $Src 'pyproject.toml'))) { throw "-Source $Src is a directory without pyproject.toml" }
        # Build from a copy: an in-tree build writes build\ and *.egg-info into the checkout.
        $copy = Join-Path $Work 'src'
        & robocopy.exe $Src $copy /E /NFL /NDL /NJH /NJS /NP /XD .git .venv venv node_modules __pycache__ build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis '*.egg-info' | Out-Null
        if ($LASTEXITCODE -ge 8) { throw "copying $Src failed (robocopy exit code $LASTEXITCODE)" }
        return "$copy$Spec"
    }
    if (Test-Path -LiteralPath $Src -PathType Leaf) { return "$((Resolve-Path -LiteralPath $Src).Path)$Spec" }
    if ($Src -match '://') { return "$Dist$Spec @ $Src" }
    if ($Src.Contains('[') -or -not $Spec) { return $Src }
    if ($Src -match '^([A-Za-z0-9._-]+)(.*)$') { return "$($Matches[1])$Spec$($Matches[2])" }
    throw "-Source ${Src}: not a directory, file, URL or requirement"
}

function Write-Utf8NoBom([string]$Path, [string]$Text) {
    # tomllib rejects the BOM that Set-Content -Encoding UTF8 writes on Windows PowerShell.
    [System.IO.File]::WriteAllText($Path, $Text, (New-Object System.Text.UTF8Encoding $false))
}

# -- C:\ProgramData\sefwd: created with its final ACL, or refused -------------------------------
# Any user may create a folder in C:\ProgramData (and owns it): the decisions below are the ones of
# deploy/windows/acl_plan.py (tests/unit/test_windows_acl_plan.py keeps the two in step).
# SIDs, not names: S-1-5-18 is LocalSystem, S-1-5-32-544 Administrators, in every language.
$FinalSids = @('S-1-5-18', 'S-1-5-32-544')
$TrustedOwners = @('S-1-5-18', 'S-1-5-32-544', 'S-1-5-80-956008885-3418522649-1831038044-1853292631-2271478464')
$FinalInheritance = 'ContainerInherit, ObjectInherit'

function New-FinalDirectorySecurity {
    # Protected (nothing inherited from C:\ProgramData): SYSTEM and Administrators, full control,
    # inherited by everything below; nobody else.
    $security = New-Object System.Security.AccessControl.DirectorySecurity
    $security.SetAccessRuleProtection($true, $false)
    foreach ($sid in $FinalSids) {
        $identity = New-Object System.Security.Principal.SecurityIdentifier $sid
        $security.AddAccessRule((New-Object System.Security.AccessControl.FileSystemAccessRule(
            $identity, 'FullControl', $FinalInheritance, 'None', 'Allow')))
    }
    return $security
}

function Get-DataDirState {
    $installer = [System.Security.Principal.WindowsIdentity]::GetCurrent().User.Value
    $item = Get-Item -LiteralPath $DataDir -Force -ErrorAction SilentlyContinue
    if (-not $item) { return @{ Exists = $false; InstallerSid = $installer } }
    $reparse = [bool]($item.Attributes -band [System.IO.FileAttributes]::ReparsePoint)
    if ($reparse) { return @{ Exists = $true; InstallerSid = $installer; IsReparsePoint = $true } }
    $acl = Get-Acl -LiteralPath $DataDir
    $owner = $acl.GetOwner([System.Security.Principal.SecurityIdentifier]).Value
    $aces = @($acl.GetAccessRules($true, $true, [System.Security.Principal.SecurityIdentifier]) | ForEach-Object {
        "$($_.IdentityReference.Value)|$($_.FileSystemRights)|$($_.InheritanceFlags)|$($_.PropagationFlags)|$($_.AccessControlType)|$($_.IsInherited)"
    })
    $untrusted = @()
    $loose = $false
    foreach ($entry in @(Get-ChildItem -LiteralPath $DataDir -Recurse -Force -Attributes !ReparsePoint -ErrorAction Stop)) {
        $entryAcl = Get-Acl -LiteralPath $entry.FullName
        $entryOwner = $entryAcl.GetOwner([System.Security.Principal.SecurityIdentifier]).Value
        if ($TrustedOwners -notcontains $entryOwner -and $entryOwner -ne $installer) { $untrusted += $entry.FullName }
        if ($entryAcl.AreAccessRulesProtected -or @($entryAcl.GetAccessRules($true, $false, [System.Security.Principal.SecurityIdentifier])).Count) { $loose = $true }
    }
    # A junction or link below (not followed by the listing above) is refused like a foreign entry.
    $untrusted += @(Get-ChildItem -LiteralPath $DataDir -Recurse -Force -Attributes ReparsePoint -ErrorAction Stop | ForEach-Object { $_.FullName })
    return @{ Exists = $true; InstallerSid = $installer; IsReparsePoint = $false; OwnerSid = $owner;
              Protected = $acl.AreAccessRulesProtected; Aces = $aces; UntrustedEntries = $untrusted; LooseEntries = $loose }
}

function Get-DataDirPlan($State) {
    # The decision table of deploy/windows/acl_plan.py, action for action.
    if (-not $State.Exists) { return @{ Action = 'create'; Reason = 'absent' } }
    if ($State.IsReparsePoint) { return @{ Action = 'refuse'; Reason = 'is a junction or symbolic link: never followed; remove it and re-run' } }
    if ($TrustedOwners -notcontains $State.OwnerSid -and $State.OwnerSid -ne $State.InstallerSid) {
        return @{ Action = 'refuse'; Reason = "is owned by $($State.OwnerSid), not SYSTEM or Administrators: someone else made it and its content (config.toml, hooks) cannot be trusted; inspect it, remove it and re-run" }
    }
    if ($State.UntrustedEntries.Count) {
        return @{ Action = 'refuse'; Reason = "holds entries owned by someone else or links ($(($State.UntrustedEntries | Select-Object -First 5) -join ', ')): inspect and remove them, then re-run" }
    }
    $final = @($FinalSids | ForEach-Object { "$_|FullControl|$FinalInheritance|None|Allow|False" })
    $same = ($State.Aces.Count -eq $final.Count) -and -not @($State.Aces | Where-Object { $final -notcontains $_ }).Count
    if ($State.Protected -and $same -and -not $State.LooseEntries) { return @{ Action = 'keep'; Reason = 'owned by a trusted owner with the final ACL' } }
    return @{ Action = 'tighten'; Reason = 'trusted owner, looser or different ACL' }
}

function Initialize-DataDir {
    $plan = Get-DataDirPlan (Get-DataDirState)
    switch ($plan.Action) {
        'refuse' { throw "$DataDir $($plan.Reason)" }
        'create' {
            # One call creates the folder with its final ACL: it never exists with C:\ProgramData's.
            if ($PSVersionTable.PSEdition -eq 'Core') {
                [System.IO.FileSystemAclExtensions]::Create((New-Object System.IO.DirectoryInfo $DataDir), (New-FinalDirectorySecurity))
            } else {
                [System.IO.Directory]::CreateDirectory($DataDir, (New-FinalDirectorySecurity)) | Out-Null
            }
            # Someone may have made it in between (CreateDirectory then changes nothing): check again.
            $after = Get-DataDirPlan (Get-DataDirState)
            if ($after.Action -ne 'keep') { throw "$DataDir $($after.Reason) (found right after creating it)" }
            Say "created $DataDir (SYSTEM and Administrators only)"
        }
        'tighten' {
            # Narrowing only: the folder's own ACL first, then everything below inherits it.
            Set-Acl -LiteralPath $DataDir -AclObject (New-FinalDirectorySecurity)
            if (@(Get-ChildItem -LiteralPath $DataDir -Force).Count) {
                Invoke-Checked icacls.exe @((Join-Path $DataDir '*'), '/reset', '/T', '/C', '/Q')
            }
            Say "tightened the ACL of $DataDir to SYSTEM and Administrators only"
        }
        'keep' { }
    }
}

function Get-ServiceHost {
    $work = Join-Path ([System.IO.Path]::GetTempPath()) ("sefwd-winsw-" + [guid]::NewGuid().ToString('N'))
    New-Item -ItemType Directory -Path $work | Out-Null
    try {
        $exe = Join-Path $work 'WinSW-x64.exe'
        if ($WinSWPath) {
            Copy-Item -LiteralPath $WinSWPath -Destination $exe
        } else {
            Say "downloading WinSW $WinSWVersion"
            [Net.ServicePointManager]::SecurityProtocol = [Net.ServicePointManager]::SecurityProtocol -bor [Net.SecurityProtocolType]::Tls12
            Invoke-WebRequest -UseBasicParsing -Uri $WinSWUrl -OutFile $exe
        }
        $hash = (Get-FileHash -Algorithm SHA256 -LiteralPath $exe).Hash
        if ($hash -ne $WinSWSha256.ToUpperInvariant()) {
            throw "WinSW-x64.exe has SHA-256 $hash, expected $WinSWSha256 (WinSW $WinSWVersion): refusing to install it"
        }
        Copy-Item -LiteralPath $exe -Destination $ServiceExe -Force
    } finally {
        Remove-Item -LiteralPath $work -Recurse -Force -ErrorAction SilentlyContinue
    }
}

# Paths are TOML literal strings ('...'): backslashes stay as they are.
$ConfigTemplate = @'
# C:\ProgramData\sefwd\config.toml: configuration of the sefwd Windows service (written by
# install.ps1, which never overwrites it). Every key, annotated:
#   & "C:\Program Files\sefwd\venv\Scripts\sefwd.exe" config example
# Check after editing, then restart:
#   & "C:\Program Files\sefwd\venv\Scripts\sefwd.exe" config check --config C:\ProgramData\sefwd\config.toml
#   Restart-Service sefwd
# Secrets never go in here: put each in a file under C:\ProgramData\sefwd\secrets (SYSTEM and
# Administrators only) and name it with the sink's *_file key.

[imds]
endpoint = "http://169.254.169.254"
api_version = "2020-07-01"
poll_interval = "1s"

[state]
dir = '@STATE_DIR@'

[agent]
heartbeat = "5m"
log_level = "info"
# Keep below the service's stop timeout (30 s).
drain_timeout = "10s"

[[sinks]]
type = "file"
name = "events-file"
path = '@LOG_DIR@\events.jsonl'
max_size = "64MiB"
backups = 5

# Azure Event Hubs with the VM's managed identity (role "Azure Event Hubs Data Sender"):
# [[sinks]]
# type = "eventhubs"
# name = "hub"
# fully_qualified_namespace = "mynamespace.servicebus.windows.net"
# eventhub = "scheduled-events"
# credential = "managed_identity"
# ... or a connection string from a file:
# connection_string_file = '@SECRETS_DIR@\eventhubs-connection-string'

# Log Analytics through a data collection rule (role "Monitoring Metrics Publisher" on the DCR):
# [[sinks]]
# type = "loganalytics"
# name = "la"
# endpoint = "https://my-dcr-abcd.westeurope-1.ingest.monitor.azure.com"
# rule_id = "dcr-00000000000000000000000000000000"
# credential = "managed_identity"

# A signed webhook (the whsec_... secret in a file):
# [[sinks]]
# type = "webhook"
# name = "ops"
# url = "https://hooks.example.com/sefwd"
# secret_file = '@SECRETS_DIR@\webhook-secret'
'@

# WinSW 2.x service definition. Stop: Ctrl+C, then stoptimeout, then kill.
$ServiceTemplate = @'
<service>
  <id>sefwd</id>
  <name>sefwd (Azure Scheduled Events forwarder)</name>
  <description>Forwards Azure IMDS Scheduled Events to sinks. Installed by install.ps1; remove with uninstall.ps1.</description>
  <executable>@SEFWD_EXE@</executable>
  <arguments>run --config "@CONFIG@"</arguments>
  <workingdirectory>@DATA_DIR@</workingdirectory>
  <startmode>Automatic</startmode>
  <stoptimeout>30 sec</stoptimeout>
  <onfailure action="restart" delay="5 sec"/>
  <resetfailure>1 hour</resetfailure>
  <logpath>@LOG_DIR@</logpath>
  <log mode="roll-by-size">
    <sizeThreshold>10240</sizeThreshold>
    <keepFiles>8</keepFiles>
  </log>
</service>
'@

function Expand-Template([string]$Text) {
    $Text = $Text.Replace('@STATE_DIR@', $StateDir).Replace('@LOG_DIR@', $LogDir).Replace('@SECRETS_DIR@', $SecretsDir)
    return $Text.Replace('@SEFWD_EXE@', $SefwdExe).Replace('@CONFIG@', $ConfigPath).Replace('@DATA_DIR@', $DataDir)
}

# -- main ----------------------------------------------------------------------------------------
$python = Find-Python
$pyVersion = Get-PythonVersion $python
Say "using $python (Python $pyVersion)"
if ($python -like "$env:SystemDrive\Users\*") {
    Write-Warning "$python is a per-user Python: the service (LocalSystem) breaks when that user's Python is removed. Prefer one installed for all users."
}

$Extras = ($Extras -replace '\s', '')
if ($Extras -notmatch '^[A-Za-z0-9,_-]*$') { throw "-Extras: expected names separated by commas, got '$Extras'" }
$spec = if ($Extras) { "[$Extras]" } else { '' }
if (-not $Source) {
    $checkout = Resolve-Path -LiteralPath (Join-Path $PSScriptRoot '..\..') -ErrorAction SilentlyContinue
    $Source = if ($checkout -and (Test-Path -LiteralPath (Join-Path $checkout.Path 'pyproject.toml'))) { $checkout.Path } else { $Dist }
}

$existing = Get-Service -Name $ServiceId -ErrorAction SilentlyContinue
if ($existing -and $existing.Status -ne 'Stopped') {
    # Windows cannot replace files a running interpreter holds open.
    Say 'stopping the running service for the upgrade'
    Stop-Service -Name $ServiceId -Force
}

$work = Join-Path ([System.IO.Path]::GetTempPath()) ("sefwd-install-" + [guid]::NewGuid().ToString('N'))
New-Item -ItemType Directory -Path $work | Out-Null
try {
    $requirement = Get-Requirement $Source $spec $work
    New-Item -ItemType Directory -Force -Path $InstallDir | Out-Null
    if (Test-Path -LiteralPath $VenvPython) {
        $have = Get-PythonVersion $VenvPython
        if (-not $have -or $have -ne $pyVersion) {
            Say "replacing the venv of Python $have with one of Python $pyVersion"
            Remove-Item -LiteralPath $Venv -Recurse -Force
        }
    }
    if (-not (Test-Path -LiteralPath $VenvPython)) {
        Say "creating $Venv"
        Invoke-Checked $python @('-m', 'venv', $Venv)
    }
    Say "pip install $($requirement -replace '\?.*$', '')"
    Invoke-Checked $VenvPython @('-m', 'pip', 'install', '--no-input', '--disable-pip-version-check', '--progress-bar', 'off', '--upgrade', $requirement)
} finally {
    Remove-Item -LiteralPath $work -Recurse -Force -ErrorAction SilentlyContinue
}
Invoke-Checked $SefwdExe @('--help') | Out-Null

Initialize-DataDir  # before anything is created or read in it
New-Item -ItemType Directory -Force -Path $SecretsDir, $StateDir, $LogDir | Out-Null  # inherit the final ACL
if (Test-Path -LiteralPath $ConfigPath) {
    Say "keeping $ConfigPath"
} else {
    Say "writing $ConfigPath"
    Write-Utf8NoBom $ConfigPath (Expand-Template $ConfigTemplate)
}

Get-ServiceHost
Write-Utf8NoBom $ServiceXml (Expand-Template $ServiceTemplate)
if ($existing) {
    # Re-register so that a changed definition (paths, timeouts) takes effect.
    Invoke-Checked $ServiceExe @('uninstall')
}
Invoke-Checked $ServiceExe @('install')
if ($NoStart) {
    Say 'registered, not started (-NoStart): Start-Service sefwd'
} else {
    Start-Service -Name $ServiceId
    Say "service $ServiceId is $((Get-Service -Name $ServiceId).Status); logs in $LogDir"
}
Say "installed; config $ConfigPath"
