#Requires -Version 5.1
#Requires -RunAsAdministrator
<#
.SYNOPSIS
    Remove the sefwd Windows service and what install.ps1 installed.

.DESCRIPTION
    Stops the service (Ctrl+C through WinSW: the agent drains its sinks first), unregisters it
    and deletes $env:ProgramFiles\sefwd (venv, WinSW and its XML).
    Kept unless -Purge: $env:ProgramData\sefwd (config.toml, secrets\, state\ with undelivered
    records and dead letters, logs\); a re-install picks them up again.

.EXAMPLE
    .\uninstall.ps1
.EXAMPLE
    .\uninstall.ps1 -Purge
#>
[CmdletBinding()]
param(
    # Also delete $env:ProgramData\sefwd: nothing of sefwd is left.
    [switch]$Purge
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'

$ServiceId = 'sefwd'
$InstallDir = Join-Path $env:ProgramFiles 'sefwd'
$ServiceExe = Join-Path $InstallDir 'sefwd-service.exe'
$DataDir = Join-Path $env:ProgramData 'sefwd'

function Say([string]$Message) { Write-Host "uninstall.ps1: $Message" }

$service = Get-Service -Name $ServiceId -ErrorAction SilentlyContinue
if ($service) {
    if ($service.Status -ne 'Stopped') {
        Say 'stopping the service'
        Stop-Service -Name $ServiceId -Force
    }
    if (Test-Path -LiteralPath $ServiceExe) {
        & $ServiceExe uninstall
    } else {
        & sc.exe delete $ServiceId | Out-Null  # WinSW is gone already: ask the service manager directly
    }
    if ($LASTEXITCODE -ne 0) { throw "unregistering the service $ServiceId failed (exit code $LASTEXITCODE)" }
    Say "service $ServiceId removed"
}
if (Test-Path -LiteralPath $InstallDir) {
    Remove-Item -LiteralPath $InstallDir -Recurse -Force
    Say "removed $InstallDir"
}
if ($Purge) {
    if (Test-Path -LiteralPath $DataDir) {
        Remove-Item -LiteralPath $DataDir -Recurse -Force
        Say "purged $DataDir"
    }
} elseif (Test-Path -LiteralPath $DataDir) {
    Say "kept $DataDir (config, secrets, state, logs); remove it with -Purge"
}
